"""A model the parameter server serves without our registry: from a worker's layout, or a user's factory.

The server needs no model class to serve a model: only the parameters and floating-point buffers,
by name and in order, and an optimizer over them. :func:`model_from_layout` rebuilds such a module
from names, shapes and values (what a worker uploads with Initialize, or what a checkpoint holds):
plain ``nn.Module`` containers nested along the dotted names, so ``named_parameters()`` and
``named_buffers()`` list exactly the given names in the given order, ``state_dict()`` keys are the
user's own names (a checkpoint loads into the user's module), and the server's optimizer steps
them like any other model. :func:`import_factory` resolves the other way to name a model, a
``"package.module:function"`` that builds it.

Values arrive as little-endian float32 bytes (or tensors, from a checkpoint); every size is checked
before anything is allocated, and non-finite values are refused.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from src.transport.wire import check_float32_bytes

Layout = Sequence[tuple[str, tuple[int, ...]]]
"""``[(dotted name, shape), ...]`` in the module's own order."""


def _children_order(first: list[str], second: list[str]) -> list[str]:
    """One order of child names consistent with both lists (each is a subsequence of the real order)."""
    merged: list[str] = []
    i = j = 0
    while i < len(first) and j < len(second):
        if first[i] == second[j]:
            merged.append(first[i])
            i, j = i + 1, j + 1
        elif first[i] in second[j:]:  # second[j] comes before first[i] in the real order
            merged.append(second[j])
            j += 1
        else:
            merged.append(first[i])
            i += 1
    merged += [name for name in first[i:] + second[j:] if name not in merged]
    return merged


def _children_by_module(names: list[str]) -> dict[str, list[str]]:
    """``{module path: its children in order of first appearance}`` along dotted ``names``."""
    children: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        for depth in range(len(parts) - 1):
            listed = children.setdefault(".".join(parts[:depth]), [])
            if parts[depth] not in listed:
                listed.append(parts[depth])
    return children


def _check_layout(layout: Layout, what: str) -> None:
    seen = set()
    for name, shape in layout:
        if not name or any(not part for part in name.split(".")):
            raise ValueError(f"{what} name {name!r} is not a dotted module path")
        if name in seen:
            raise ValueError(f"{what} {name!r} is listed twice")
        seen.add(name)
        if any(int(d) < 0 for d in shape) or len(shape) > 16:
            raise ValueError(f"{what} {name!r} has an invalid shape {list(shape)}")


def _as_tensor(value: Any, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{what}: shape {list(value.shape)}, expected {list(shape)}")
        tensor = value.detach().to("cpu", torch.float32).clone()
    else:
        check_float32_bytes(value, math.prod(shape), what)  # before allocating anything
        tensor = (
            torch.frombuffer(bytearray(value), dtype=torch.float32).view(shape)
            if math.prod(shape)
            else torch.zeros(shape)
        )
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what}: holds NaN or Inf values")
    return tensor


def model_from_layout(
    parameters: Layout, buffers: Layout, parameter_values: Sequence[Any], buffer_values: Sequence[Any]
) -> nn.Module:
    """A module holding exactly these parameters and buffers, by name and in order.

    Args:
        parameters, buffers: ``[(dotted name, shape), ...]`` as the worker's module lists them.
        parameter_values, buffer_values: one value per entry: float32 bytes or a tensor.

    Raises:
        ValueError: a bad name, a repeated name, a size that does not match its shape, a
            non-finite value, or a layout no module tree can have (a name both a tensor and a module).
    """
    _check_layout(parameters, "parameter")
    _check_layout(buffers, "buffer")
    if len(parameter_values) != len(parameters) or len(buffer_values) != len(buffers):
        raise ValueError(
            f"{len(parameter_values)} parameter and {len(buffer_values)} buffer values for "
            f"{len(parameters)} parameters and {len(buffers)} buffers"
        )
    param_names, buffer_names = [n for n, _ in parameters], [n for n, _ in buffers]
    by_params, by_buffers = _children_by_module(param_names), _children_by_module(buffer_names)
    root = nn.Module()
    modules = {"": root}

    def build(path: str) -> None:
        for child in _children_order(by_params.get(path, []), by_buffers.get(path, [])):
            child_path = f"{path}.{child}" if path else child
            module = nn.Module()
            modules[path].add_module(child, module)
            modules[child_path] = module
            build(child_path)

    build("")
    try:
        for (name, shape), value in zip(parameters, parameter_values):
            owner, _, leaf = name.rpartition(".")
            modules[owner].register_parameter(leaf, nn.Parameter(_as_tensor(value, shape, f"parameter {name}")))
        for (name, shape), value in zip(buffers, buffer_values):
            owner, _, leaf = name.rpartition(".")
            modules[owner].register_buffer(leaf, _as_tensor(value, shape, f"buffer {name}"))
    except (AttributeError, KeyError, TypeError) as exc:  # torch refuses a name taken by a module
        raise ValueError(f"impossible layout: {exc}") from None
    rebuilt = ([n for n, _ in root.named_parameters()], [n for n, _ in root.named_buffers()])
    if rebuilt != (param_names, buffer_names):
        raise ValueError("impossible layout: no module tree lists these names in this order")
    return root


def layout_mismatch(
    layout: tuple[Layout, Layout],
    parameters: tuple[Sequence[str], Sequence[tuple[int, ...]]],
    buffers: tuple[Sequence[str], Sequence[tuple[int, ...]]],
) -> str | None:
    """The first difference between ``layout`` (params, buffers) and a served model's names and shapes, or ``None``."""
    for what, given, (names, shapes) in (("parameter", layout[0], parameters), ("buffer", layout[1], buffers)):
        served = list(zip(names, (tuple(s) for s in shapes)))
        given = [(n, tuple(s)) for n, s in given]
        if len(given) != len(served):
            return f"{len(given)} {what}s, the server's model has {len(served)}"
        for index, (mine, theirs) in enumerate(zip(given, served)):
            if mine != theirs:
                return f"{what} {index} is {mine[0]} {list(mine[1])}, the server's is {theirs[0]} {list(theirs[1])}"
    return None


def import_factory(spec: str) -> Callable[[], nn.Module]:
    """``"package.module:function"`` -> that function (it builds the model when called with no arguments).

    Raises:
        ValueError: not of that form, or the module or attribute cannot be found.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"model factory {spec!r}: expected 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model factory {spec!r}: cannot import {module_name} ({exc})") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"model factory {spec!r}: {module_name} has no attribute {attribute}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"model factory {spec!r}: {attribute} is not callable")
    return target
