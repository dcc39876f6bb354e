"""DeepSpeed's ``"optimizer": {"type": "Muon"}`` (``MuonWithAuxAdam``) as zeroshard's Muon engine.

DeepSpeed 0.19.8 tags every parameter of two or more dimensions whose name holds neither
"embed" nor "lm_head" for Muon (``set_optimizer_flags``), and splits each param group the
user passes into a Muon half and an Adam half (``DeepSpeedEngine._muon_param_groups``), each
taking the config's shared value, then ``muon_lr`` / ``adam_lr``, then the group's own, then
``MuonWithAuxAdam``'s defaults. zeroshard builds the same groups, in the same order:
``torch.optim.Muon`` on the Muon halves (the same update: docs/DEEPSPEED.md, "DeepSpeed's
Muon against torch.optim.Muon") and torch's AdamW (Adam with ``adam_w_mode: false``) on the
rest, under a group's ``"optimizer"`` key. A checkpoint DeepSpeed saved then loads into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from .optimizer import _own_flag
from .values import arguments, number, refusal

MUON_TYPE = "muon"
# What each half takes from the config and from a param group (DeepSpeed's _MUON_HALF_KEYS /
# _ADAM_HALF_KEYS), and MuonWithAuxAdam's defaults for what neither gives.
MUON_KEYS = ("lr", "momentum", "weight_decay")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
NS_METHODS = ("gram", "standard")
NOT_ON_MUON = ("embed", "lm_head")  # names DeepSpeed keeps off Muon, whatever their shape


@dataclass(frozen=True)
class MuonHalves:
    """The two optimizers a DeepSpeed Muon config names, with the config's settings of each."""

    adam_class: type[torch.optim.Optimizer]
    muon_settings: dict[str, Any] = field(default_factory=dict)
    adam_settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def param_groups(self, model: nn.Module, param_groups: Iterable[Any] | None) -> list[dict[str, Any]]:
        """Each of the user's param groups (None: one of every trainable parameter) split as
        DeepSpeed splits it: its Muon half, then its Adam half, each left out when empty."""
        groups = _user_groups(model, param_groups)
        on_muon = {id(param) for name, param in model.named_parameters() if _is_muon(name, param)}
        halves = []
        for group in groups:
            trainable = [param for param in group["params"] if param.requires_grad]
            for muon, keys, settings, defaults in (
                (True, MUON_KEYS, self.muon_settings, MUON_DEFAULTS),
                (False, ADAM_KEYS, self.adam_settings, ADAM_DEFAULTS),
            ):
                params = [param for param in trainable if (id(param) in on_muon) is muon]
                if not params:
                    continue
                own = {key: value for key, value in group.items() if key in keys}
                half: dict[str, Any] = {"params": params, **defaults, **settings, **own}
                if not muon:
                    half["optimizer"] = self.adam_class
                halves.append(half)
        return halves


def is_muon(section: Any) -> bool:
    """Whether the config's ``optimizer`` section names DeepSpeed's Muon."""
    return isinstance(section, Mapping) and str(section.get("type", "")).lower() == MUON_TYPE


def muon_halves(params: Mapping[str, Any], clipping: float) -> MuonHalves:
    """The halves ``optimizer.params`` of a Muon section asks for, checked.

    Raises:
        ValueError: one line naming the key: a key DeepSpeed's Muon does not take or a value
            torch's Muon or AdamW refuses, ``per_head_muon`` (torch's Muon orthogonalises
            whole matrices), an ``ns_method`` DeepSpeed does not know, or
            ``gradient_clipping`` (DeepSpeed clips Muon's orthogonalised updates; zeroshard
            clips gradients).
    """
    params = dict(params)
    if clipping > 0:
        raise refusal(
            "gradient_clipping",
            clipping,
            "with Muon DeepSpeed clips the orthogonalised updates, zeroshard the gradients before the momentum; "
            "drop it, or pass max_grad_norm= to clip the gradients",
        )
    if _own_flag(params, "per_head_muon", False):
        raise refusal("optimizer.params.per_head_muon", True, "torch's Muon orthogonalises each matrix whole")
    adam_w_mode = _own_flag(params, "adam_w_mode", True)
    torch_adam = _own_flag(params, "torch_adam", False)
    ns_method = params.pop("ns_method", "gram")
    if ns_method not in NS_METHODS:
        raise refusal("optimizer.params.ns_method", ns_method, f"DeepSpeed's Muon takes one of {list(NS_METHODS)}")
    shared = {key: params.pop(key) for key in ("lr", "weight_decay") if key in params}
    muon = {**{k: v for k, v in shared.items() if k in MUON_KEYS}, **_take(params, ("momentum",))}
    adam = {**shared, **_take(params, ("betas", "eps"))}
    for own, half in (("muon_lr", muon), ("adam_lr", adam)):
        if own in params:
            key = f"optimizer.params.{own}"
            half["lr"] = number({key: params.pop(own)}, key, 0.0)
    if params:
        key = sorted(params)[0]
        raise refusal(f"optimizer.params.{key}", params[key], "DeepSpeed's Muon does not take it")
    adam_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    muon = arguments(torch.optim.Muon, muon, "optimizer.params", skip=("params",))
    adam = arguments(adam_class, adam, "optimizer.params", skip=("params",))
    notes = [
        f"DeepSpeed's Muon orthogonalises by its {ns_method!r} Newton-Schulz in half precision on the gradients' "
        "dtype; zeroshard runs torch.optim.Muon (the same update: momentum, Nesterov, 5 steps, coefficients, "
        "lr adjustment) on fp32 gradients and momentum: rounded differently"
    ]
    if not torch_adam:
        notes.append(
            f"DeepSpeed ran FusedAdam (or Muon's inline Adam) beside Muon (optimizer.params.torch_adam is false); "
            f"zeroshard runs {adam_class.__module__}.{adam_class.__name__}: the same update, rounded differently"
        )
    return MuonHalves(adam_class, muon, adam, notes)


def _take(params: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: params.pop(key) for key in keys if key in params}


def _is_muon(name: str, param: nn.Parameter) -> bool:
    """DeepSpeed's tag: a matrix (two or more dimensions) not named as an embedding or head."""
    return param.dim() >= 2 and not any(word in name.lower() for word in NOT_ON_MUON)


def _user_groups(model: nn.Module, param_groups: Iterable[Any] | None) -> list[dict[str, Any]]:
    """The user's groups as dicts; loose parameters (or none given: every one) in a last group."""
    items = list(model.parameters() if param_groups is None else param_groups)
    groups = [dict(item) for item in items if isinstance(item, Mapping)]
    loose = [item for item in items if not isinstance(item, Mapping)]
    for group in groups:
        group["params"] = list(group["params"]) if not isinstance(group["params"], torch.Tensor) else [group["params"]]
    if loose or not groups:
        groups.append({"params": loose})
    return groups
