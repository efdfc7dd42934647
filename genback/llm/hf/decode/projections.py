"""The decode step's linear projections as fewer, larger matrix products:
``DecodeStep.fuse_projections`` (on by default on CUDA).

At a decode step's row counts a linear layer is bound by reading its weight, and a small weight
is read at a smaller share of the bandwidth: on an H100, 8B Llama shape, 16 rows
(``benchmarks/RESULTS.md``, "Issue 38, part 1 on an H200 and an H100 (session 59)") the key and
value products (8 MiB each) ran at ~43 % of the copy bandwidth, the query's (32 MiB) at ~67 %,
gate and up (112 MiB each) at ~85 %. Serving engines store each attention layer's query, key and
value weights as one matrix, and the MLP's gate and up as one (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``, gpt-fast's ``wqkv``), so each group is one product.

:class:`FusedProjections` does that without a second copy of the weights. Once, when it is made,
the weights of each group of ``torch.nn.Linear`` modules named in :data:`GROUPS` under one parent
module (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``) are laid out as
consecutive row blocks of one contiguous tensor, and each module's weight (and bias) becomes a
view of its block: the same values, shapes and contiguous layout, so every other forward of the
model computes what it did, bit for bit, and ``save_pretrained`` writes the same files. Weights
already laid out so (by an earlier :class:`FusedProjections` on the same model, or by the
loader) are used as they are, never copied again: a captured graph reads them where they are.

Inside ``with fused:`` (the decode step's warm-ups and captures: a replay runs what was
captured) the group's first module computes the whole group's product in one
``torch.nn.functional.linear`` and keeps it with its input; a later module of the group called
on that same input tensor returns its block of the product's columns (a view), and on any other
input computes its own product. So the result is each module's own product whatever its parent
calls (transformers' attention layers call the query, key and value projections on one hidden
state, its MLPs gate and up on one), within the rounding of one larger product against three
(the columns' dot products are the same sums; a kernel may block them differently).
"""

from __future__ import annotations

import itertools

import torch

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of the sibling ``torch.nn.Linear`` modules fused into one product, in their order in
the joined weight (transformers' attention layers and MLPs of the Llama family, Mistral, Qwen2
and 3, Gemma, Granite and others that name them so)."""


def joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive row blocks ``tensors`` (2-D, or 1-D for biases) are: one
    storage, each contiguous and starting where the one before ends; None if they are not laid
    out so. A view of their storage: no copy."""
    first = tensors[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for t in tensors:
        if (t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous()
                or t.storage_offset() != offset or t.shape[1:] != first.shape[1:]):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))


def join(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """:func:`joined` of ``params``' data; when they are not laid out so, a new contiguous
    tensor of their rows, each parameter's ``data`` then made a view of its block (the
    parameter objects and their values stay). Call it outside inference mode.

    Raises:
        torch.OutOfMemoryError: no room for the new tensor (the parameters are left as they
            were).
    """
    data = [p.detach() for p in params]
    whole = joined(data)
    if whole is not None:
        return whole
    with torch.no_grad():
        whole = torch.cat(data)
    start = 0
    for p in params:
        p.data = whole[start:start + p.shape[0]]
        start += p.shape[0]
    return whole


def _fusable(modules: list) -> bool:
    """Whether ``modules`` can share one product: plain ``torch.nn.Linear`` modules without
    hooks or a replaced ``forward``, of one input size, weights of one dtype on one (real)
    device, biases on all or none."""
    first = modules[0]
    return all(
        type(m) is torch.nn.Linear and not m._forward_hooks and not m._forward_pre_hooks
        and "forward" not in vars(m) and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype and m.weight.device == first.weight.device
        and m.weight.device.type != "meta" and (m.bias is None) == (first.bias is None)
        for m in modules)


def _where(modules) -> list:
    """The data addresses of each module's weight and bias."""
    return [(m.weight.data_ptr(), None if m.bias is None else m.bias.data_ptr())
            for m in modules]


class _Group:
    """One group's modules, its joined weight and bias, and the last product with its input."""

    __slots__ = ("parent", "names", "modules", "weight", "bias", "bounds", "where", "last")

    def __init__(self, parent, names, modules, weight, bias):
        self.parent, self.names, self.modules = parent, names, modules
        self.weight, self.bias = weight, bias
        ends = list(itertools.accumulate(m.out_features for m in modules))
        self.bounds = list(zip([0] + ends[:-1], ends))
        self.where = _where(modules)
        self.last: tuple | None = None  # (input, product) of the group's first module

    def current(self) -> bool:
        """The parent still holds the same modules, whose weights (and biases) are still the
        joined tensors' blocks (a LoRA wrapper, a replaced module or parameter: not fused)."""
        return (all(getattr(self.parent, n, None) is m for n, m in zip(self.names, self.modules))
                and _where(self.modules) == self.where)

    def forwards(self) -> list:
        """Each module's forward for the ``with``."""
        def first(x: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.linear(x, self.weight, self.bias)
            self.last = (x, y)
            a, b = self.bounds[0]
            return y.narrow(-1, a, b - a)

        def member(module, a: int, b: int):
            def forward(x: torch.Tensor) -> torch.Tensor:
                last = self.last  # (one read: another thread may set it meanwhile)
                if last is not None and last[0] is x:
                    return last[1].narrow(-1, a, b - a)
                return torch.nn.functional.linear(x, module.weight, module.bias)
            return forward

        return [first] + [member(m, a, b) for m, (a, b) in zip(self.modules[1:], self.bounds[1:])]


class FusedProjections:
    """The model's fusable :data:`GROUPS` (their weights joined once, when made: see the
    module's doc), and ``with fused:`` to run forwards with one product per group.

    Args:
        model: the transformers model (its parameters may be re-laid, values unchanged).

    Attributes:
        count: groups fused (0: nothing to fuse, the context does nothing).
        relaid: groups whose weights this instance laid out anew (0 when they already were,
            e.g. by an earlier instance: then no tensor any graph reads has moved). A group
            with no room on its device for the copy stays apart (unfused, unchanged).
    """

    def __init__(self, model: torch.nn.Module):
        self.groups: list[_Group] = []
        self.relaid = 0
        candidates = []
        for parent in model.modules():
            for names in GROUPS:
                modules = [getattr(parent, n, None) for n in names]
                if all(isinstance(m, torch.nn.Module) for m in modules) and _fusable(modules):
                    candidates.append((parent, names, modules))
        counts: dict[int, int] = {}  # (a module or parameter in two groups is fused in neither)
        for _, _, modules in candidates:
            for m in modules:
                for key in (id(m), id(m.weight)):
                    counts[key] = counts.get(key, 0) + 1
        with torch.inference_mode(False):
            for parent, names, modules in candidates:
                if any(counts[id(m)] > 1 or counts[id(m.weight)] > 1 for m in modules):
                    continue
                where = _where(modules)
                try:
                    weight = join([m.weight for m in modules])
                    bias = None if modules[0].bias is None else join([m.bias for m in modules])
                except torch.OutOfMemoryError:  # (no room for a group's copy: it stays apart)
                    weight = None
                self.relaid += _where(modules) != where
                if weight is not None:
                    self.groups.append(_Group(parent, names, modules, weight, bias))
        self.count = len(self.groups)
        self._entered: list[list] = []

    def __enter__(self) -> "FusedProjections":
        swapped = []
        for g in self.groups:
            if g.current():
                for m, fn in zip(g.modules, g.forwards()):
                    m.forward = fn
                swapped.append(g)
        self._entered.append(swapped)
        return self

    def __exit__(self, *exc) -> None:
        for g in self._entered.pop():
            g.last = None  # (no tensor of a forward kept)
            for m in g.modules:
                vars(m).pop("forward", None)


__all__ = ["FusedProjections", "GROUPS", "join", "joined"]
