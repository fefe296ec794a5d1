"""Real ``transformers`` models split across a prefill and a decode process (``kvxfer demo
--model``): in every layout and for every prompt length the generated tokens equal a
single-process greedy run and every decode step's logits are bitwise equal, also after the
request was retracted to host and restored into different pages and slot; deliberate
misplacements (a page, a head, a token, a Mamba state, the conv window, the first token, a
restore order) make the check fail.

Heterogeneous TP (1:2 and 2:1): every rank its own process, pools of the rank's real
geometry and the real heterogeneous-TP transfer; the model runs whole in every process and
decode rank 0 generates from the decode ranks' received shares (emulated TP model): the
same token-identical, bitwise-logits check, and a share in the wrong rank is caught.

One set of worker processes (two prefill and two decode ranks, spawned, real UCX on loopback)
holds all three tiny models for the whole module; equal-TP runs use rank 0 of each side. Its
start-up (torch + transformers imports) dominates the run time.
``transformers`` is pinned in the test dependencies; without it the workers fail loudly.
"""

import json

import pytest

from kvxfer.pd_demo.hf_run import HFCheck, main, report_ok
from kvxfer.pd_demo.hf_spec import MODELS

pytestmark = pytest.mark.timeout(360)  # the first test also starts the workers (<= 240 s)

PAGE, CHUNK = 8, 16
PROMPTS = (5, 8, 21, 50)  # shorter than a page, a page, not a multiple, four chunks
RUN = dict(prompts=PROMPTS, n_tokens=5, retract_after=2, chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def check():
    with HFCheck(
        list(MODELS),
        page_size=PAGE,
        pool_tokens=512,
        timeout=60.0,
        start_timeout=240.0,
        prefill_tp=2,
        decode_tp=2,
    ) as c:
        yield c


@pytest.mark.parametrize("model", list(MODELS))
def test_every_layout_is_token_identical(check, model):
    r = check.run([model], prefill_tp=1, decode_tp=1, **RUN)
    assert r["layouts"] == list(MODELS[model][2])
    assert report_ok(r), [x for x in r["runs"] if not (x["tokens_match"] and x["logits_equal"])]
    assert len(r["runs"]) == len(MODELS[model][2]) * len(PROMPTS)
    for x in r["runs"]:
        assert x["transfer"] == "Success" and x["first_logits_equal"]
        assert x["tokens"] == x["reference"] and len(x["tokens"]) == 5
        assert x["chunks"] == -(-x["prompt_len"] // CHUNK)
        rt = x["retract"]  # moved to other pages (and slot) mid-generation
        assert rt["retract_at"] == x["prompt_len"] + 2
        assert len(rt["new_pages"]) == len(rt["old_pages"]) == -(-rt["retract_at"] // PAGE)
        assert not set(rt["new_pages"]) & set(rt["old_pages"])
        if model == "bamba":
            assert rt["new_slot"] != rt["old_slot"]
    entries = {p["layout"]: (p["kv_entries"], p["state_entries"]) for p in r["pools"]}
    expected = {
        "nhd": (6, 0),
        "hnd": (6, 0),
        "page_major": (1, 0),
        "page_major+envelope": (1, 1),
        "nhd+per_layer": (4, 4),
        "mla": (2, 0),
    }
    assert entries == {k: expected[k] for k in entries}


# (model, layout, prompt length, corruption, the tokens differ too). Prompt 21 has a partial
# last page, so swapping it with the first moves its empty tail into the prompt; restoring
# 18 tokens (prompt 16 + 2) reversed does the same. swap_tokens only permutes (K, V) rows:
# attention is invariant to that up to summation order, so only the bitwise logits catch it.
CORRUPT = [
    ("llama", "hnd", 21, "swap_heads", True),
    ("llama", "page_major", 21, "swap_pages", True),
    ("llama", "nhd", 21, "swap_tokens", False),
    ("llama", "nhd", 16, "restore_reversed", True),
    ("bamba", "page_major+envelope", 21, "swap_state", True),
    ("bamba", "nhd+per_layer", 21, "conv_window", True),
    ("bamba", "page_major+envelope", 5, "first_token", True),
    ("deepseek", "mla", 21, "swap_pages", True),
]


@pytest.mark.parametrize(
    "model,layout,n,corrupt,tokens_differ", CORRUPT, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CORRUPT]
)
def test_misplacement_is_caught(check, model, layout, n, corrupt, tokens_differ):
    r = check.run(
        [model],
        layouts=[layout],
        prompts=(n,),
        n_tokens=5,
        retract_after=2,
        chunk_tokens=CHUNK,
        corrupt=corrupt,
        prefill_tp=1,
        decode_tp=1,
    )
    (x,) = r["runs"]
    assert x["transfer"] == "Success" and not r["problems"]
    assert not report_ok(r) and not r["logits_equal"]
    if corrupt == "restore_reversed":  # fine until the restore
        assert x["first_logits_equal"] and x["tokens"][:3] == x["reference"][:3]
    else:
        assert not x["first_logits_equal"]
    if tokens_differ:
        assert not r["tokens_match"], x


def test_cli_json_last_line_and_exit_status(check, capsys):
    argv = [
        "--model",
        "llama",
        "--layouts",
        "page_major",
        "--prompts",
        "5,21",
        "--new-tokens",
        "4",
        "--retract-after",
        "1",
        "--json",
    ]
    assert main(argv, check=check) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    r = json.loads(lines[-1])
    assert {"model", "layouts", "prompts", "tokens_match", "logits_equal", "generated"} <= set(r)
    assert r["model"] == "llama" and r["layouts"] == ["page_major"] and r["prompts"] == [5, 21]
    assert r["tokens_match"] is True and r["logits_equal"] is True
    assert {k: len(v) for k, v in r["generated"]["page_major"].items()} == {"5": 4, "21": 4}
    assert "all 2 runs token-identical" in "\n".join(lines[:-1])
    assert main(argv + ["--corrupt", "swap_heads"], check=check) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1])["tokens_match"] is False and "MISMATCH" in lines[-2]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "gpt2"], "choose from"),
        (["--model", "llama", "--layouts", "mla"], "does not fit"),
        (["--model", "bamba", "--layouts", "nhd"], "needs a Mamba layout"),
        (["--model", "llama", "--chunk-tokens", "12"], "multiple of --page-size"),
        (["--model", "llama", "--retract-after", "9"], "--retract-after"),
        (["--model", "llama", "--prefill-tp", "3", "--decode-tp", "2"], "one must divide"),
        (["--model", "bamba", "--decode-tp", "8"], "do not split over tp 8"),
        (["--model", "llama", "--corrupt", "swap_ranks"], "swap_ranks needs"),
    ],
)
def test_bad_arguments_exit_2_before_starting_workers(argv, message, capsys):
    from kvxfer.demo import main as demo_main  # `kvxfer demo --model ...` routes here

    with pytest.raises(SystemExit) as exc:
        demo_main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


#: (prefill tp, decode tp) -> model -> layouts run there
TP_PLAN = {
    (1, 2): {"llama": ["nhd", "page_major"], "bamba": ["nhd+per_layer"], "deepseek": ["mla"]},
    (2, 1): {"llama": ["nhd", "hnd"], "bamba": ["page_major+envelope"], "deepseek": ["mla"]},
}
TP_PROMPTS = (5, 21)  # within a page; a partial last page over two chunks


@pytest.mark.parametrize("tp", list(TP_PLAN), ids=[f"{p}to{d}" for p, d in TP_PLAN])
def test_heterogeneous_tp_is_token_identical(check, tp):
    tp_p, tp_d = tp
    for model, layouts in TP_PLAN[tp].items():
        r = check.run(
            [model],
            layouts=layouts,
            prompts=TP_PROMPTS,
            n_tokens=5,
            retract_after=2,
            chunk_tokens=CHUNK,
            prefill_tp=tp_p,
            decode_tp=tp_d,
        )
        assert (r["prefill_tp"], r["decode_tp"]) == tp and r["layouts"] == layouts
        bad = [x for x in r["runs"] if not (x["tokens_match"] and x["logits_equal"])]
        assert report_ok(r), (r["problems"], bad)
        assert len(r["runs"]) == len(layouts) * len(TP_PROMPTS)
        for x in r["runs"]:
            assert x["transfer"] == "Success" and x["tokens"] == x["reference"]
            assert len(x["tokens"]) == 5 and x["retract"]["retract_at"] == x["prompt_len"] + 2
        for p in r["pools"]:  # each rank's pool holds its share, in the rank's geometry
            assert p["tp"] == [0, tp_p] and p["decode"]["tp"] == [0, tp_d]
            if model != "deepseek":  # 2 KV heads split; MLA: the latent is replicated
                assert p["heads"] == [0, 2 // tp_p] and p["decode"]["heads"] == [0, 2 // tp_d]
            else:
                assert p["heads"] == p["decode"]["heads"] == [0, 1]
            whole = p["page_bytes"] * tp_p if model != "deepseek" else p["page_bytes"]
            assert p["decode"]["page_bytes"] * (tp_d if model != "deepseek" else 1) == whole
        if model == "llama":  # only the shares moved: each page once, an aux row per rank
            for x in r["runs"]:
                assert x["bytes"] == x["pages"] * r["pools"][0]["page_bytes"] * tp_p + 64 * tp_d


# (tp, model, layout): the shares of TP ranks 0 and 1 exchanged -- at 2:1 by the prefill
# ranks, at 1:2 by decode's gather -- must fail the check
SWAP = [((1, 2), "llama", "nhd"), ((2, 1), "bamba", "nhd+per_layer")]


@pytest.mark.parametrize(
    "tp,model,layout", SWAP, ids=[f"{s[1]}-{s[0][0]}to{s[0][1]}" for s in SWAP]
)
def test_share_in_the_wrong_rank_is_caught(check, tp, model, layout):
    r = check.run(
        [model],
        layouts=[layout],
        prompts=(21,),
        n_tokens=5,
        retract_after=2,
        chunk_tokens=CHUNK,
        corrupt="swap_ranks",
        prefill_tp=tp[0],
        decode_tp=tp[1],
    )
    (x,) = r["runs"]
    assert x["transfer"] == "Success" and not r["problems"]
    assert not report_ok(r) and not x["first_logits_equal"] and not r["tokens_match"]


def test_cli_heterogeneous_tp(check, capsys):
    argv = ["--model", "llama", "--layouts", "hnd", "--prompts", "8", "--new-tokens", "3"]
    argv += ["--retract-after", "1", "--decode-tp", "2", "--json"]
    assert main(argv, check=check) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    r = json.loads(lines[-1])
    assert (r["prefill_tp"], r["decode_tp"]) == (1, 2) and r["tokens_match"] is True
    assert "at TP 1:2" in lines[0] and "all 1 runs token-identical" in lines[-2]
