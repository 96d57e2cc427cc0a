import collections
import dataclasses
import types
from typing import Optional

import pytest
import torch

from conftest import ModelOutputLike

from ampkit import _dtypes
from ampkit._dtypes import HALF_DTYPES, capability, recommend_policy, resolve_dtype
from ampkit.policy import get_policy


@pytest.mark.parametrize("name, dtype", [
    ("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
    ("fp32", torch.float32), ("float32", torch.float32), ("float", torch.float32),
])
def test_aliases(name, dtype):
    assert resolve_dtype(name) is dtype
    assert resolve_dtype(dtype) is dtype


def test_bad_dtypes():
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'; valid names: .*bf16"):
        resolve_dtype("fp8")
    with pytest.raises(ValueError, match=r"half_dtype torch.float32 is not allowed.*fp16.*bf16"):
        resolve_dtype(torch.float32, allowed=HALF_DTYPES, what="half_dtype")
    with pytest.raises(TypeError, match="must be a torch.dtype or a name, got int"):
        resolve_dtype(16)  # type: ignore[arg-type]


def test_device_types():
    assert _dtypes.check_device_type("cpu") == "cpu"
    with pytest.raises(ValueError, match=r"unknown device type 'gpu'; valid: 'cpu', 'cuda'"):
        _dtypes.check_device_type("gpu")


def test_cpu_capability_and_recommendation_are_consistent():
    cap = capability("cpu")
    assert cap.fp8 is False and not _dtypes.fp8_supported("cpu")
    name, reason = recommend_policy("cpu")
    get_policy(name)  # always a valid policy name
    assert reason
    assert name == ("bf16-mixed" if cap.bf16 else "32-true")


def test_cpu_without_half_hardware_recommends_fp32(monkeypatch):
    capability.cache_clear()
    monkeypatch.setattr(_dtypes, "_cpu_flags", lambda: {"cpu_name": "plain"})
    try:
        assert recommend_policy("cpu")[0] == "32-true"
        assert "slower" in recommend_policy("cpu")[1]
    finally:
        capability.cache_clear()


def test_autocast_defaults():
    assert _dtypes.autocast_default_dtype("cpu") is torch.bfloat16
    assert _dtypes.autocast_default_dtype("cuda") is torch.float16


@pytest.mark.parametrize("cap, recommended, candidates, bench", [
    (_dtypes.Capability("cuda:0", "H200", True, True, True), "bf16-mixed",
     ("32-true", "bf16-mixed", "O2-bf16", "16-mixed", "O2-fp16", "fp8"),
     ("32-true", "16-mixed", "bf16-mixed", "O2", "fp8")),
    (_dtypes.Capability("cuda:0", "V100", False, True, False), "16-mixed",
     ("32-true", "16-mixed", "O2-fp16"), ("32-true", "16-mixed", "O2")),
    (_dtypes.Capability("cpu", "Xeon", True, True, False), "bf16-mixed",
     ("32-true", "bf16-mixed", "O2-bf16"), ("32-true", "bf16-mixed", "O2")),
    (_dtypes.Capability("cpu", "plain", False, False, False), "32-true",
     ("32-true",), ("32-true", "bf16-mixed", "O2")),
])
def test_one_policy_table_answers_info_bench_and_autotune(monkeypatch, cap, recommended,
                                                          candidates, bench):
    from ampkit.cli.bench import default_policies
    from ampkit.tune import native_candidates

    monkeypatch.setattr(_dtypes, "capability", lambda device=None: cap)
    monkeypatch.setattr(_dtypes, "fp8_supported", lambda device=None: cap.fp8)
    table = _dtypes.device_policies(cap.device)
    assert (table.recommended, table.candidates, table.bench) == (recommended, candidates, bench)
    assert recommend_policy(cap.device) == (table.recommended, table.reason)
    assert native_candidates(cap.device) == list(candidates)
    assert default_policies(cap.device) == ",".join(bench)
    from ampkit.tune import fp8_recipe

    for name in candidates:  # each a policy name, or an fp8 candidate autotune resolves
        assert fp8_recipe(name) is not None or get_policy(name) is not None


def test_cast_tree_keeps_a_defaultdicts_factory():
    """It came back a plain dict: a missing key then raised KeyError inside a region only."""
    import collections
    from ampkit._dtypes import cast_tree
    tree = collections.defaultdict(list, x=torch.ones(1))
    cast = cast_tree(tree, torch.bfloat16)
    assert type(cast) is collections.defaultdict and cast["missing"] == []
    assert cast["x"].dtype is torch.bfloat16 and "missing" not in tree


@dataclasses.dataclass
class _CausalOutput(ModelOutputLike):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None


def test_a_transformers_model_output_keeps_its_type_and_fields():
    """It came back a plain dict (its update() raises, and the rebuild fell back): an HF
    model under O1/O2/O3 then failed on out.loss, out[0] and generate()."""
    from ampkit._dtypes import cast_tree
    out = _CausalOutput(loss=torch.ones(()), logits=torch.ones(2, 3, dtype=torch.bfloat16))
    cast = cast_tree(out, torch.float32)
    assert type(cast) is _CausalOutput and cast is not out
    assert list(cast.keys()) == ["loss", "logits"] and cast.hidden is None
    assert cast.logits.dtype is torch.float32 and cast["logits"] is cast.logits
    assert cast[1] is cast.logits and cast.loss is out.loss
    assert out.logits.dtype is torch.bfloat16  # the model's own object is left as it was


@dataclasses.dataclass
class _Pair:
    h: torch.Tensor
    ids: torch.Tensor
    note: str = "pair"


@dataclasses.dataclass(frozen=True)
class _FrozenNest:
    pair: _Pair
    extra: list
    n: int = dataclasses.field(init=False, default=0)


def test_cast_tree_and_iter_tensors_walk_dataclasses_frozen_or_not():
    """They passed dataclass instances through: a kept module's fp32 output in one never
    went back to half (O2), nor did its half input become fp32 (autocast)."""
    from ampkit._dtypes import cast_tree, iter_tensors
    h, ids, e = torch.randn(2, 3, dtype=torch.bfloat16), torch.arange(2), torch.ones(1)
    tree = _FrozenNest(_Pair(h, ids), [e])
    assert [t is u for t, u in zip(iter_tensors(tree), (h, ids, e))] == [True] * 3
    cast = cast_tree(tree, torch.float32)
    assert type(cast) is _FrozenNest and type(cast.pair) is _Pair and cast.pair.note == "pair"
    assert cast.pair.h.dtype is torch.float32 and torch.equal(cast.pair.h, h.float())
    assert cast.pair.ids is ids and cast.extra[0] is e
    assert tree.pair.h is h and tree.pair.h.dtype is torch.bfloat16  # the caller's: unchanged
    pair = _Pair(h, ids)
    assert cast_tree(pair, torch.bfloat16, sources=(torch.float16,)) is pair  # nothing cast


@dataclasses.dataclass
class _Later:  # an init=False field the user sets after construction
    h: torch.Tensor
    aux: torch.Tensor = dataclasses.field(init=False, default=None)


@dataclasses.dataclass(frozen=True)
class _Scaled:  # an InitVar without a default and a __post_init__ that must run once
    h: torch.Tensor
    scale: dataclasses.InitVar[float]
    calls: list = dataclasses.field(default_factory=list)

    def __post_init__(self, scale: float) -> None:
        object.__setattr__(self, "h", self.h * scale)
        self.calls.append(scale)


@dataclasses.dataclass
class _Base:
    h: torch.Tensor


class _OwnInit(_Base):  # a subclass with its own __init__ signature
    def __init__(self, values: list) -> None:
        super().__init__(torch.tensor(values))


@dataclasses.dataclass
class _Node:
    h: torch.Tensor
    parent: object = None
    children: list = dataclasses.field(default_factory=list)


def test_cast_tree_rebuilds_a_dataclass_without_running_its_init():
    """dataclasses.replace rebuilt it from its init fields: an init=False field set later
    was dropped, an InitVar without a default raised ValueError, __post_init__ ran again
    and a subclass with its own __init__ raised TypeError."""
    from ampkit._dtypes import cast_tree, iter_tensors
    later = _Later(torch.ones(2))
    later.aux = torch.full((1,), 3.0)
    cast = cast_tree(later, torch.bfloat16)
    assert cast.aux.dtype is torch.bfloat16 and torch.equal(cast.aux.float(), later.aux)
    assert [t.dtype for t in iter_tensors(cast)] == [torch.bfloat16] * 2
    scaled = _Scaled(torch.ones(2), 2.0)
    cast = cast_tree(scaled, torch.bfloat16)
    assert type(cast) is _Scaled and cast.calls == scaled.calls == [2.0]  # __post_init__: once
    assert torch.equal(cast.h, torch.full((2,), 2.0, dtype=torch.bfloat16))
    own = cast_tree(_OwnInit([1.0, 2.0]), torch.float16)
    assert type(own) is _OwnInit and own.h.dtype is torch.float16


def test_a_dataclass_cycle_is_walked_once():
    """A parent pointer sent cast_tree and iter_tensors into a RecursionError; a back
    pointer met while its instance is walked stays the caller's original."""
    from ampkit._dtypes import cast_tree, iter_tensors
    root = _Node(torch.ones(1))
    child = _Node(torch.zeros(1), parent=root)
    root.children += [child, child]
    assert [t is u for t, u in zip(iter_tensors(root), (root.h, child.h))] == [True, True]
    assert len(list(iter_tensors(root))) == 2
    cast = cast_tree(root, torch.bfloat16)
    assert cast.h.dtype is torch.bfloat16 and cast.children[0].h.dtype is torch.bfloat16
    assert cast.children[0] is cast.children[1]  # one instance, one result
    assert cast.children[0].parent is root and root.children[0] is child
    loop = _Node(torch.ones(1), children=None)
    loop.parent = loop
    assert cast_tree(loop, torch.float32) is loop  # nothing cast: the instance itself
    assert cast_tree(loop, torch.float16).parent is loop


def test_the_common_leaves_skip_the_dataclass_check(monkeypatch):
    """Every non-tensor leaf paid for a dataclass check (a 14-scalar kwargs dict: 5 to 12 us
    in cast_tree, 4 to 15 us in iter_tensors, on every converted forward)."""
    from ampkit._dtypes import cast_tree, iter_tensors

    def refuse(obj):
        raise AssertionError(f"dataclass check on {obj!r}")

    monkeypatch.setattr(_dtypes, "_is_dataclass_instance", refuse)
    x = torch.ones(1)
    tree = ((x, 3, "s", 1.5, True, None), {"dtype": torch.float16, "device": torch.device("cpu")})
    assert list(iter_tensors(tree)) == [x]
    assert cast_tree(tree, torch.bfloat16)[0][0].dtype is torch.bfloat16


class _Encoding(collections.UserDict):
    """transformers' BatchEncoding in small: a UserDict with state of its own."""

    def __init__(self, data=None, note="enc"):
        super().__init__(data)
        self.note = note


def test_a_userdict_is_walked_and_rebuilt_as_its_own_type():
    """A UserDict (transformers' BatchEncoding) was a leaf: its tensors were neither cast,
    found, nor detached, so inspect's passes shared the caller's tensors."""
    from ampkit._dtypes import cast_tree, iter_tensors, map_tensors
    ids, x = torch.arange(3), torch.ones(2)
    batch = _Encoding({"ids": ids, "x": x, "n": 3}, note="kept")
    cast = cast_tree(batch, torch.bfloat16)
    assert type(cast) is _Encoding and cast is not batch and cast.note == "kept"
    assert cast["x"].dtype is torch.bfloat16 and cast["ids"] is ids and cast["n"] == 3
    assert batch["x"] is x and batch.data is not cast.data  # the caller's is left as it was
    assert list(iter_tensors(batch)) == [ids, x]
    assert map_tensors(batch, lambda t: t) is batch  # nothing changed: itself
    proxy = types.MappingProxyType({"x": x})  # cannot be copied: a plain dict
    doubled = map_tensors(proxy, lambda t: t * 2)
    assert type(doubled) is dict and torch.equal(doubled["x"], x * 2)


class _SharedStore(collections.abc.MutableMapping):
    """A mapping whose copy.copy shares its storage (no __copy__ of its own)."""

    def __init__(self, **items):
        self.store = dict(items)

    def __getitem__(self, key):
        return self.store[key]

    def __setitem__(self, key, value):
        self.store[key] = value

    def __delitem__(self, key):
        del self.store[key]

    def __iter__(self):
        return iter(self.store)

    def __len__(self):
        return len(self.store)


def test_a_mapping_whose_copy_shares_its_storage_is_left_as_it_was():
    from ampkit._dtypes import cast_tree
    x = torch.ones(2)
    batch = _SharedStore(x=x, y=torch.ones(2))
    cast = cast_tree(batch, torch.float16)
    assert batch["x"] is x and batch["y"].dtype is torch.float32
    assert type(cast) is dict and cast["x"].dtype is cast["y"].dtype is torch.float16


class _Converting(_SharedStore):
    """A mapping that stores lists and hands out a new tensor at each read (its copy has
    a storage of its own)."""

    def __copy__(self):
        return _Converting(**self.store)

    def __getitem__(self, key):
        value = self.store[key]
        return torch.tensor(value) if isinstance(value, list) else value


def test_a_mapping_handing_out_new_objects_is_not_written_to():
    """Its reads never return the old object, which the shared-storage check took for a
    write that reached the original: it then wrote a tensor into the caller's mapping."""
    from ampkit._dtypes import cast_tree
    batch = _Converting(x=[1.0, 2.0])
    cast = cast_tree(batch, torch.float16)
    assert batch.store == {"x": [1.0, 2.0]}
    assert type(cast) is _Converting and cast["x"].dtype is torch.float16
