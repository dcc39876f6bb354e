"""The torch optimizer a DeepSpeed config's ``optimizer`` section names.

DeepSpeed's "Adam" and "AdamW" become torch's Adam or AdamW by DeepSpeed's own rule (type
"Adam" decouples weight decay unless ``adam_w_mode`` is false; the same rule the checkpoint
importer follows). Without ``torch_adam`` DeepSpeed ran its FusedAdam or DeepSpeedCPUAdam:
the same update, rounded differently, whose default ``weight_decay`` is 0 (torch's AdamW
has 0.01), so that default is carried over. Any other name is torch.optim's, as in
DeepSpeed; DeepSpeed's own optimizers (Lamb, Lion, 1-bit, MuP) are refused. Its Muon
(``MuonWithAuxAdam``) is torch's Muon beside torch's AdamW: :mod:`.muon`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .values import arguments, flag, refusal, required_arguments, setting

# DeepSpeed's optimizers of its own, by the lower-case name DeepSpeed matches.
DEEPSPEED_OWN = ("lamb", "lion", "muadam", "muadamw", "musgd", "onebitadam", "zerooneadam", "onebitlamb")
# torch optimizers whose step refuses dense gradients, the only ones ZeroOptimizer has.
SPARSE_ONLY = ("sparseadam",)


def optimizer_from_config(
    section: Any, client_optimizer: type[torch.optim.Optimizer] | None
) -> tuple[type[torch.optim.Optimizer], dict[str, Any], list[str]]:
    """(optimizer class, its keyword arguments, notes on what differs from DeepSpeed) for
    the config's ``optimizer`` section, or the client optimizer class when there is none.
    The arguments are checked against the class's signature (:func:`~.values.arguments`).

    Raises:
        ValueError: no optimizer at all or two of them, a DeepSpeed-only optimizer, one whose
            step ZeroOptimizer cannot run, an argument the optimizer does not take or of
            another type, or a DeepSpeed option zeroshard cannot honour.
    """
    if section is None:
        if client_optimizer is None:
            raise ValueError("DeepSpeed config refused: it has no optimizer section; pass optimizer_class=")
        return client_optimizer, {}, []
    if client_optimizer is not None:
        raise ValueError("DeepSpeed config refused: optimizer: the config names one and optimizer_class= gives another")
    if not isinstance(section, Mapping):
        raise refusal("optimizer", section, "must be {'type': NAME, 'params': {...}}")
    name = section.get("type")
    if not isinstance(name, str):
        raise refusal("optimizer.type", name, "must be the name of an optimizer (a string)")
    params = setting(section, "params", {})
    if not isinstance(params, Mapping):
        raise refusal("optimizer.params", params, "must be a JSON object of the optimizer's arguments")
    params = dict(params)
    if "max_grad_norm" in params:
        raise ValueError(
            "DeepSpeed config refused: optimizer.params.max_grad_norm: use gradient_clipping (DeepSpeed refuses it too)"
        )
    if name.lower() in ("adam", "adamw"):
        optimizer_class, notes = _adam(name.lower(), params)
    elif name.lower() in DEEPSPEED_OWN:
        raise ValueError(
            f"DeepSpeed config refused: optimizer.type = {name!r}: DeepSpeed's own optimizer; "
            "pass optimizer_class= a torch optimizer instead"
        )
    else:
        optimizer_class = torch.optim.Adagrad if name.lower() == "adagrad" else getattr(torch.optim, name, None)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"DeepSpeed config refused: optimizer.type = {name!r}: not a torch.optim optimizer")
        _check_steps_here(name, optimizer_class)
        notes = []
    return optimizer_class, arguments(optimizer_class, params, "optimizer.params", skip=("params",)), notes


def _check_steps_here(name: str, optimizer_class: type[torch.optim.Optimizer]) -> None:
    """Refuse an optimizer whose step ZeroOptimizer.step cannot run (it would fail there)."""
    if optimizer_class.step is torch.optim.Optimizer.step:
        raise refusal("optimizer.type", name, "the base class of torch's optimizers, not an optimizer")
    needs = required_arguments(optimizer_class.step)
    if needs:
        raise refusal(
            "optimizer.type",
            name,
            f"its step() needs a {needs[0]} that re-runs the forward and backward; ZeroOptimizer.step takes none",
        )
    if name.lower() in SPARSE_ONLY:
        raise refusal("optimizer.type", name, "it takes sparse gradients only; zeroshard reduces dense ones")


def _adam(kind: str, params: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], list[str]]:
    """Torch's Adam or AdamW for DeepSpeed's; ``params`` loses DeepSpeed's own options."""
    adam_w_mode = _own_flag(params, "adam_w_mode", True)  # DeepSpeed takes it from AdamW too
    decoupled = kind == "adamw" or adam_w_mode
    torch_adam = _own_flag(params, "torch_adam", False)
    if not _own_flag(params, "fp32_optimizer_states", True):
        raise ValueError(
            "DeepSpeed config refused: optimizer.params.fp32_optimizer_states = False: zeroshard keeps them in fp32"
        )
    optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    if torch_adam:
        return optimizer_class, []
    if not _own_flag(params, "bias_correction", True):
        raise ValueError(
            "DeepSpeed config refused: optimizer.params.bias_correction = False: torch's Adam always corrects"
        )
    if _own_flag(params, "amsgrad", False):
        raise ValueError(
            "DeepSpeed config refused: optimizer.params.amsgrad = True: DeepSpeed's FusedAdam refuses it too"
        )
    _own_flag(params, "set_grad_none", True)
    params.setdefault("weight_decay", 0.0)  # FusedAdam's and DeepSpeedCPUAdam's default
    note = (
        f"DeepSpeed ran its FusedAdam / DeepSpeedCPUAdam (optimizer.params.torch_adam is false); zeroshard runs "
        f"{optimizer_class.__module__}.{optimizer_class.__name__}: the same update, rounded differently"
    )
    return optimizer_class, [note]


def _own_flag(params: dict[str, Any], name: str, default: bool) -> bool:
    """Take DeepSpeed's own option ``name`` (a bool) out of ``params``."""
    key = f"optimizer.params.{name}"
    return flag({key: params.pop(name, None)}, key, default)
