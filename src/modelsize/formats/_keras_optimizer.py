"""What a Keras 3 optimizer's saved variables are, from the ``compile_config`` of a model.

A ``.keras`` archive stores the optimizer's variables anonymously (``optimizer/vars/0``,
``optimizer/vars/1``...): ``iteration`` and ``learning_rate``, then the slots each optimizer
class makes for every trainable variable. Their names are Keras's own (``keras/src/optimizers``:
``add_optimizer_variables(var_list, ["momentum", "velocity"])`` for Adam), chosen by the class
and a few of its options; :func:`optimizer_facts` turns the config into inventory facts so that
a report can say "Adam optimizer state (momentum, velocity)" instead of "vars".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: class name -> the slot names it makes for each variable, given its config.
_SLOTS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "Adam": lambda c: ["momentum", "velocity"] + (["velocity_hat"] if c.get("amsgrad") else []),
    "AdamW": lambda c: ["momentum", "velocity"] + (["velocity_hat"] if c.get("amsgrad") else []),
    "Nadam": lambda c: ["momentum", "velocity"],
    "Lamb": lambda c: ["momentum", "velocity"],
    "Adamax": lambda c: ["momentum", "norm"],
    "Adadelta": lambda c: ["accumulated_grad", "accumulated_delta_var"],
    "Adagrad": lambda c: ["accumulator"],
    "Ftrl": lambda c: ["accumulator", "linear"],
    "Lion": lambda c: ["momentum"],
    "SGD": lambda c: ["momentum"] if c.get("momentum") else [],
    "RMSprop": lambda c: ["velocity"] + (["momentum"] if c.get("momentum") else [])
    + (["average_gradient"] if c.get("centered") else []),
}


def optimizer_facts(config: object) -> dict[str, str]:
    """``{"optimizer": class name, "optimizer_slots": "momentum, velocity"}`` from a Keras
    ``config.json`` (empty when it names no optimizer)."""
    compile_config = config.get("compile_config") if isinstance(config, dict) else None
    opt = compile_config.get("optimizer") if isinstance(compile_config, dict) else None
    if not isinstance(opt, dict) or not isinstance(opt.get("class_name"), str):
        return {}
    name = opt["class_name"][:60]
    facts = {"optimizer": name}
    given = opt.get("config")
    options: dict[str, Any] = given if isinstance(given, dict) else {}
    slots = _SLOTS[name](options) if name in _SLOTS else []
    if slots:
        facts["optimizer_slots"] = ", ".join(slots)
    return facts
