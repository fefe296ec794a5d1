"""Plain values of the real-model check (``kvxfer demo --model``, ``examples/hf_pd.py``): the
tiny ``transformers`` models, the pool layouts each one runs in, and the deliberate
corruptions. No torch here: the parent process only schedules and compares.

Every model is built by ``transformers`` from the config below with seeded random weights
(no download), float32 on CPU. A layout is ``"<kv>"`` or ``"<kv>+<mamba>"``:

* kv: ``nhd`` / ``hnd`` (:class:`~kvxfer.pools.mha.MHATokenToKVPool`, one K and one V buffer per
  layer), ``page_major`` (:class:`~kvxfer.pools.page_major.PageMajorMHATokenToKVPool`, one buffer,
  a page holds every layer), ``mla`` (:class:`~kvxfer.pools.mla.MLATokenToKVPool`, latent + rope);
* mamba: ``envelope`` (a slot is every layer's state back to back, one descriptor) or
  ``per_layer`` (one descriptor per state tensor and layer), in a
  :class:`~kvxfer.pools.hybrid.HybridLinearKVPool` with the kv pool.

Bamba is the hybrid: its Mamba2 layers and attention layers are separate layers (the
disjoint id sets :class:`~kvxfer.pools.hybrid.HybridLinearKVPool` maps; Falcon-H1 runs both in every
layer), it is dense (Jamba adds MoE and Mamba1 state), transformers runs it on CPU with its
torch path, and its state is exactly what the Mamba pool holds for SGLang: a conv window
``[conv_dim, kernel - 1]`` and an SSM state ``[heads, head_dim, state]``.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from kvxfer.errors import InvalidArgument

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=1024,
    initializer_range=0.2,
)

#: name -> (transformers config class name, config kwargs, layouts run by default)
MODELS: Dict[str, Tuple[str, dict, Tuple[str, ...]]] = {
    # Llama-style GQA: 4 query heads share 2 KV heads
    "llama": (
        "LlamaConfig",
        dict(_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2),
        ("nhd", "hnd", "page_major"),
    ),
    # Bamba: Mamba2 layers 0, 2 and attention layers 1, 3
    "bamba": (
        "BambaConfig",
        dict(
            _COMMON,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[1, 3],
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
        ),
        ("page_major+envelope", "nhd+per_layer"),
    ),
    # DeepSeek-V3 MLA: the cache holds the normalised latent (32) and the roped key (8);
    # layer 0 dense, layer 1 MoE
    "deepseek": (
        "DeepseekV3Config",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        ("mla",),
    ),
}

KV_LAYOUTS = ("nhd", "hnd", "page_major", "mla")
MAMBA_LAYOUTS = ("envelope", "per_layer")

#: deliberate misplacements the decode side can apply (the check must then fail)
CORRUPTIONS = {
    "swap_pages": "exchange the bytes of the request's first and last page on arrival",
    "swap_heads": "exchange KV heads 0 and 1 of every token on arrival",
    "swap_tokens": "exchange the K/V rows of the first and the last prompt token on arrival",
    "swap_state": "exchange the state of the first two Mamba layers on arrival",
    "conv_window": "reverse the token order of the conv window on arrival",
    "first_token": "add 1 to the first token read from the aux row",
    "restore_reversed": "restore a retracted request into its new pages in reverse order",
    "swap_ranks": "heterogeneous TP: TP ranks 2i and 2i+1 exchange their shares (each prefill "
    "rank stores and sends the other's heads and state rows; with one prefill rank, decode "
    "rank 0 gathers decode ranks 0 and 1's shares each in the other's place)",
}


def split_layout(layout: str) -> Tuple[str, str]:
    """``"page_major+envelope"`` -> ``("page_major", "envelope")``; ``"nhd"`` -> ``("nhd", "")``."""
    kv, _, mamba = layout.partition("+")
    if kv not in KV_LAYOUTS or (mamba and mamba not in MAMBA_LAYOUTS):
        raise InvalidArgument(
            f"layout {layout!r}: expected <kv>[+<mamba>] with kv in "
            f"{KV_LAYOUTS} and mamba in {MAMBA_LAYOUTS}"
        )
    return kv, mamba


def check_layout(model: str, layout: str) -> None:
    """Typed error when ``layout`` cannot hold ``model``'s cache."""
    kv, mamba = split_layout(layout)
    hybrid = model == "bamba"
    if hybrid != bool(mamba):
        raise InvalidArgument(
            f"model {model!r} {'needs' if hybrid else 'has no'} a Mamba layout (got {layout!r})"
        )
    if (kv == "mla") != (model == "deepseek"):
        raise InvalidArgument(
            f"layout {layout!r} does not fit model {model!r} "
            f"(MLA latents need the mla pool, and only there)"
        )


def models_arg(text: str) -> List[str]:
    names = list(MODELS) if text == "all" else [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad or not names:
        raise InvalidArgument(f"--model {text!r}: choose from {', '.join(MODELS)} or 'all'")
    return names


def check_tp(model: str, prefill_tp: int, decode_tp: int) -> None:
    """Typed error unless ``model`` splits over both TP sizes: one size divides the other,
    the KV heads split over (or are replicated by) each size (MLA: the latent is replicated,
    any size), and for a hybrid the SSM heads and each conv part (``x | B | C``) split."""
    if min(prefill_tp, decode_tp) < 1 or max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise InvalidArgument(
            f"--prefill-tp {prefill_tp} / --decode-tp {decode_tp}: one must divide the other"
        )
    cfg = MODELS[model][1]
    for tp in {prefill_tp, decode_tp}:
        heads = cfg["num_key_value_heads"]
        if model != "deepseek" and max(heads, tp) % min(heads, tp):
            raise InvalidArgument(f"model {model!r}: {heads} KV heads do not split over tp {tp}")
        if model == "bamba":
            bc = cfg.get("mamba_n_groups", 1) * cfg["mamba_d_state"]
            units = (cfg["mamba_n_heads"], cfg["mamba_expand"] * cfg["hidden_size"], bc)
            if any(u % tp for u in units):
                raise InvalidArgument(
                    f"model {model!r}: SSM heads / conv parts {units} do not split over tp {tp}"
                )
