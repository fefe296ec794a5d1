"""``KVXFER_CHANNEL_WAIT``: native frames by default, ``yield`` for the old UCXX path (A/B),
anything else refused with a typed error."""

import pytest

from kvxfer.errors import InvalidArgument
from kvxfer.transport.ucx_channel import channel_wait_mode

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    "value,mode",
    [
        (None, "native"),
        ("", "native"),
        ("native", "native"),
        (" YIELD ", "yield"),
        ("yield", "yield"),
    ],
)
def test_modes(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("KVXFER_CHANNEL_WAIT", raising=False)
    else:
        monkeypatch.setenv("KVXFER_CHANNEL_WAIT", value)
    assert channel_wait_mode() == mode


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("KVXFER_CHANNEL_WAIT", "spin")
    with pytest.raises(InvalidArgument, match="KVXFER_CHANNEL_WAIT"):
        channel_wait_mode()
