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

#: the data types an optimizer step records with DATA_TYPES["all"], by file prefix
STEP_PREFIXES = (
    "grad_reduced",
    "param_origin",
    "param_updated",
    "exp_avg",
    "exp_avg_sq",
    "other",
    "grad_unreduced",
)
