"""Which torch optimizer a DeepSpeed checkpoint's run used, for the run and for each param group.

DeepSpeed's "Adam" and "AdamW" (torch's with ``torch_adam``, else its FusedAdam or
DeepSpeedCPUAdam: the same update, rounded differently) are torch's AdamW, or torch's Adam
where ``adam_w_mode`` is false. Its Muon (``MuonWithAuxAdam``) runs two: Muon on the groups
saying ``use_muon: true``, that same Adam on the rest; those are torch's Muon (the same
update: momentum, Nesterov, Newton-Schulz coefficients and steps, the lr adjustment
``sqrt(max(1, rows / cols))``, decoupled weight decay; docs/DEEPSPEED.md says where it
rounds differently) and the Adam half's class, recorded per param group, as zeroshard's
own runs with several optimizer classes record them. Reading a checkpoint imports no torch:
classes are named by their import path, as torch 2.13 names them.
"""

from __future__ import annotations

from typing import Any

ADAMW = "torch.optim.adamw.AdamW"
ADAM = "torch.optim.adam.Adam"
MUON = "torch.optim.Muon"  # torch.optim.Muon's module.QualName (torch 2.13)
MUON_TYPE = "muon"  # DeepSpeed's optimizer name, as it matches it (lower case)


def deepspeed_optimizer(ds_config: dict[str, Any]) -> dict[str, Any]:
    """What DeepSpeed built from the config's ``optimizer`` section (engine.py,
    ``_configure_basic_optimizer``): the type, whether torch's Adam(W) ran, decoupled decay
    (for Muon: of the Adam beside it)."""
    section = ds_config.get("optimizer") or {}
    params = section.get("params") or {}
    kind = str(section.get("type", "")).lower()
    info: dict[str, Any] = {"type": section.get("type"), "torch_adam": bool(params.get("torch_adam", False))}
    if kind in ("adam", "adamw", MUON_TYPE):
        # DeepSpeed's "Adam" decouples weight decay too unless adam_w_mode is false; so does Muon's Adam.
        info["adam_w_mode"] = kind == "adamw" or bool(params.get("adam_w_mode", True))
        info["implementation"] = (
            (ADAMW if info["adam_w_mode"] else ADAM) if info["torch_adam"] else "deepspeed FusedAdam / DeepSpeedCPUAdam"
        )
    return info


def optimizer_class(ds_config: dict[str, Any], param_groups: list[dict[str, Any]]) -> str:
    """The torch optimizer class whose update the saved run used, by its import path; for
    Muon the classes of its groups in the order they first appear, joined by ``+`` (as a
    zeroshard run with several classes names them); ``"deepspeed:<type>"`` for DeepSpeed's
    own optimizers (Lamb, Lion, ...)."""
    ds = deepspeed_optimizer(ds_config)
    if str(ds["type"]).lower() == MUON_TYPE:
        return "+".join(dict.fromkeys(_muon_classes(ds, param_groups))) or MUON
    if "adam_w_mode" in ds:
        return ADAMW if ds["adam_w_mode"] else ADAM
    name = ds["type"]
    if name is None:
        # A client optimizer: torch (>= 2.6) records decoupled_weight_decay in Adam's groups.
        decoupled = param_groups[0].get("decoupled_weight_decay") if param_groups else None
        if decoupled is not None and "betas" in param_groups[0]:
            return ADAMW if decoupled else ADAM
        return "deepspeed:client optimizer"
    # Names DeepSpeed has no optimizer of its own for are torch.optim's.
    return TORCH_OPTIMIZERS.get(str(name), f"deepspeed:{name}")


def group_optimizers(ds_config: dict[str, Any], param_groups: list[dict[str, Any]]) -> list[str]:
    """Each param group's optimizer class (``param_groups``: rank 0's saved hyperparameters,
    whose ``use_muon`` flags :func:`~.muon.muon_groups` checked) where the run used more
    than one, else ``""`` for every group (the run's one class says it)."""
    ds = deepspeed_optimizer(ds_config)
    classes = _muon_classes(ds, param_groups) if str(ds["type"]).lower() == MUON_TYPE else []
    return classes if len(set(classes)) > 1 else [""] * len(param_groups)


def _muon_classes(ds: dict[str, Any], param_groups: list[dict[str, Any]]) -> list[str]:
    """MuonWithAuxAdam's groups: torch's Muon where ``use_muon`` is true, else its Adam's class."""
    adam = ADAMW if ds["adam_w_mode"] else ADAM
    return [MUON if group.get("use_muon") is True else adam for group in param_groups]


# torch.optim's optimizers (torch 2.13) by name, as import paths, so that reading a
# checkpoint needs no torch import. Muon is left out: DeepSpeed's "Muon" is MuonWithAuxAdam.
TORCH_OPTIMIZERS = {
    name: f"torch.optim.{module}{name}"
    for name, module in (
        ("ASGD", "asgd."), ("Adadelta", "adadelta."), ("Adafactor", ""), ("Adagrad", "adagrad."),
        ("Adam", "adam."), ("AdamW", "adamw."), ("Adamax", "adamax."), ("LBFGS", "lbfgs."), ("NAdam", "nadam."),
        ("RAdam", "radam."), ("RMSprop", "rmsprop."), ("Rprop", "rprop."), ("SGD", "sgd."),
        ("SparseAdam", "sparse_adam."),
    )
}
