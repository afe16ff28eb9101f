"""Monitor configs the adapter tests of every framework share: one per data type, and all at once."""

from __future__ import annotations

#: the config switches of each data type an optimizer step collects (activations differ per framework)
DATA_TYPES = {
    "wg": {"wg_distribution": True},
    "wg_mbs": {"wg_distribution": True, "monitor_mbs_grad": True},
    "mv": {"mv_distribution": True},
    "param": {"param_distribution": True},
    "mg": {"mg_direction": True},
    "all": {
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "mg_direction": True,
    },
}
