"""The torch optimizer a DeepSpeed config's ``optimizer`` section names.

DeepSpeed's "Adam" and "AdamW" become torch's Adam or AdamW by DeepSpeed's own rule (type
"Adam" decouples weight decay unless ``adam_w_mode`` is false; the same rule the checkpoint
importer follows). Without ``torch_adam`` DeepSpeed ran its FusedAdam or DeepSpeedCPUAdam:
the same update, rounded differently, whose default ``weight_decay`` is 0 (torch's AdamW
has 0.01), so that default is carried over. Any other name is torch.optim's, as in
DeepSpeed; DeepSpeed's own optimizers (Lamb, Lion, Muon, 1-bit, MuP) are refused.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

# DeepSpeed's optimizers of its own, by the lower-case name DeepSpeed matches.
DEEPSPEED_OWN = ("lamb", "lion", "muon", "muadam", "muadamw", "musgd", "onebitadam", "zerooneadam", "onebitlamb")


def optimizer_from_config(
    section: Any, client_optimizer: type[torch.optim.Optimizer] | None
) -> tuple[type[torch.optim.Optimizer], dict[str, Any], list[str]]:
    """(optimizer class, its keyword arguments, notes on what differs from DeepSpeed) for
    the config's ``optimizer`` section, or the client optimizer class when there is none.

    Raises:
        ValueError: no optimizer at all or two of them, a DeepSpeed-only optimizer, an
            argument the optimizer does not take, or a DeepSpeed option zeroshard cannot honour.
    """
    if section is None:
        if client_optimizer is None:
            raise ValueError("DeepSpeed config refused: it has no optimizer section; pass optimizer_class=")
        return client_optimizer, {}, []
    if client_optimizer is not None:
        raise ValueError("DeepSpeed config refused: optimizer: the config names one and optimizer_class= gives another")
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        raise ValueError(
            f"DeepSpeed config refused: optimizer = {section!r}: must be {{'type': NAME, 'params': {{...}}}}"
        )
    name = section["type"]
    params = dict(section.get("params") or {})
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
        notes = []
    _check_arguments(optimizer_class, params)
    return optimizer_class, params, notes


def _adam(kind: str, params: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], list[str]]:
    """Torch's Adam or AdamW for DeepSpeed's; ``params`` loses DeepSpeed's own options."""
    decoupled = kind == "adamw" or bool(params.pop("adam_w_mode", True))
    torch_adam = bool(params.pop("torch_adam", False))
    if params.pop("fp32_optimizer_states", None) is False:
        raise ValueError(
            "DeepSpeed config refused: optimizer.params.fp32_optimizer_states = False: zeroshard keeps them in fp32"
        )
    optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])
    if torch_adam:
        return optimizer_class, []
    if params.pop("bias_correction", True) is not True:
        raise ValueError(
            "DeepSpeed config refused: optimizer.params.bias_correction = False: torch's Adam always corrects"
        )
    if params.pop("amsgrad", False):
        raise ValueError(
            "DeepSpeed config refused: optimizer.params.amsgrad = True: DeepSpeed's FusedAdam refuses it too"
        )
    params.pop("set_grad_none", None)
    params.setdefault("weight_decay", 0.0)  # FusedAdam's and DeepSpeedCPUAdam's default
    note = (
        f"DeepSpeed ran its FusedAdam / DeepSpeedCPUAdam (optimizer.params.torch_adam is false); zeroshard runs "
        f"{optimizer_class.__module__}.{optimizer_class.__name__}: the same update, rounded differently"
    )
    return optimizer_class, [note]


def _check_arguments(optimizer_class: type, params: Mapping[str, Any]) -> None:
    accepted = set(inspect.signature(optimizer_class).parameters) - {"params", "self"}
    unknown = sorted(key for key in params if key not in accepted)
    if unknown:
        raise ValueError(
            f"DeepSpeed config refused: optimizer.params.{unknown[0]}: {optimizer_class.__name__} takes "
            f"{', '.join(sorted(accepted))}"
        )
