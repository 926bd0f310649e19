"""The original Python ``stageload`` 0.1.1's documented behaviours, run against the original and
against ``stageload_rs``: the same test body passes for both, so moving from the original is one
import line (``import stageload_rs as stageload``).

The original is imported from the folder that ``STAGELOAD_ORIGINAL`` names (default: beside the
torch environment, where ``scripts/setup-reference.sh`` installs it and which it prints).
Tests whose assertions hold for one implementation only say so in their names.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

ORIGINAL_DEFAULT = str(Path(sys.prefix).parent / "original-stageload-0.1.1")


def import_impl(which: str) -> types.ModuleType:
    """Imports ``stageload_rs``, or the original ``stageload`` from ``STAGELOAD_ORIGINAL``."""
    if which == "stageload_rs":
        return importlib.import_module("stageload_rs")
    folder = Path(os.environ.get("STAGELOAD_ORIGINAL", ORIGINAL_DEFAULT))
    if not (folder / "stageload" / "__init__.py").is_file():
        pytest.fail(
            f"the original stageload 0.1.1 is not at {folder} (no stageload/__init__.py there): "
            "set STAGELOAD_ORIGINAL to its folder, or run scripts/setup-reference.sh, which "
            "installs it and prints STAGELOAD_ORIGINAL",
            pytrace=False,
        )
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    module = importlib.import_module("stageload")
    assert Path(module.__file__).resolve().parent == (folder / "stageload").resolve(), (
        f"imported stageload from {module.__file__}, not from STAGELOAD_ORIGINAL={folder}"
    )
    return module


@pytest.fixture(params=["original", "stageload_rs"])
def impl(request: pytest.FixtureRequest) -> types.ModuleType:
    """The package under test: the original ``stageload`` or ``stageload_rs``."""
    return import_impl(request.param)


@pytest.fixture
def original() -> types.ModuleType:
    """The original ``stageload`` alone, for assertions about its own mechanism."""
    return import_impl("original")


@pytest.fixture
def stageload_rs() -> types.ModuleType:
    """``stageload_rs`` alone, for assertions about its own mechanism."""
    return import_impl("stageload_rs")


class Counted:
    """A loader that builds ``nn.Linear(8, 8)`` and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> nn.Module:
        self.calls += 1
        return nn.Linear(8, 8)


def storage_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameter and buffer storages, each distinct storage once."""
    seen: dict[int, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def works(module: nn.Module) -> None:
    out = module(torch.ones(2, 8))
    assert out.shape == (2, 8)


def registry(impl: types.ModuleType, names: str = "ab", **kwargs):
    loaders = {name: Counted() for name in names}
    stages = kwargs.pop("stages", {"first": ["a"], "second": ["b"]})
    return impl.StagedModels(loaders, stages=stages, **kwargs), loaders


# 1. mapping semantics


def test_getitem_loads_on_first_use_and_then_returns_the_same_object(impl):
    models, loaders = registry(impl)
    first = models["a"]
    assert loaders["a"].calls == 1
    assert models["a"] is first
    assert loaders["a"].calls == 1
    works(first)


def test_membership_and_len_never_load(impl):
    models, loaders = registry(impl)
    assert "a" in models
    assert "missing" not in models
    assert len(models) == 2
    assert sorted(models) == ["a", "b"]
    assert list(iter(models)) == ["a", "b"]
    assert all(loader.calls == 0 for loader in loaders.values())


def test_values_and_items_only_yield_loaded_models(impl):
    models, loaders = registry(impl)
    assert list(models.values()) == []
    assert list(models.items()) == []
    a = models["a"]
    assert list(models.values()) == [a]
    assert list(models.items()) == [("a", a)]
    assert loaders["b"].calls == 0


def test_a_stored_module_is_released_by_a_stage_not_listing_it_and_cannot_come_back(impl):
    models, _ = registry(impl)
    stored = nn.Linear(8, 8)
    models["extra"] = stored
    assert "extra" in models
    assert models["extra"] is stored
    models.enter("first")
    with pytest.raises(impl.ReleasedModuleError):
        models["extra"]


def test_del_forgets_a_model_without_loading_it(impl):
    models, loaders = registry(impl)
    del models["b"]
    assert "b" not in models
    assert len(models) == 1
    assert loaders["b"].calls == 0


def test_del_and_clear_release_a_loaded_model(impl):
    models, _ = registry(impl)
    a, b = models["a"], models["b"]
    del models["a"]
    with pytest.raises(impl.ReleasedModuleError):
        a(torch.ones(2, 8))
    works(b)
    models.clear()
    with pytest.raises(impl.ReleasedModuleError):
        b(torch.ones(2, 8))


def test_pop_hands_a_model_over_loaded_and_forgets_it(impl):
    models, loaders = registry(impl)
    b = models.pop("b")
    assert loaders["b"].calls == 1
    assert "b" not in models
    assert len(models) == 1
    works(b)
    a = models["a"]
    assert models.pop("a") is a
    works(a)
    assert len(models) == 0


def test_pop_of_a_missing_name_returns_the_default_or_raises_key_error(impl):
    models, _ = registry(impl)
    sentinel = object()
    assert models.pop("missing", sentinel) is sentinel
    assert models.pop("missing", None) is None
    with pytest.raises(KeyError):
        models.pop("missing")


def test_popitem_hands_over_the_last_name(impl):
    models, loaders = registry(impl)
    name, module = models.popitem()
    assert name == "b"
    assert loaders["b"].calls == 1
    works(module)
    assert list(models) == ["a"]


def test_clear_empties_the_registry(impl):
    models, _ = registry(impl)
    models["a"]
    models.clear()
    assert len(models) == 0
    assert "a" not in models
    assert list(models) == []


# 2. enter, pin, close


def test_enter_releases_loaded_models_the_stage_does_not_list(impl):
    models, loaders = registry(impl)
    models["a"]
    models["b"]
    models.enter("second")
    assert [name for name, _ in models.items()] == ["b"]
    assert loaders["b"].calls == 1


def test_pinned_models_survive_a_stage_that_does_not_list_them(impl):
    models, _ = registry(impl)
    a = models["a"]
    models.pin("a")
    models.enter("second")
    assert [name for name, _ in models.items()] == ["a"]
    works(a)
    models.unpin("a")
    models.enter("second")
    assert list(models.items()) == []


def test_pinned_at_construction_survives_a_stage_change(impl):
    models, _ = registry(impl, pinned=["a"])
    a = models["a"]
    models.enter("second")
    works(a)


def test_pin_of_an_unknown_name_raises_key_error(impl):
    models, _ = registry(impl)
    with pytest.raises(KeyError):
        models.pin("missing")


def test_entering_an_unknown_stage_raises_key_error(impl):
    models, _ = registry(impl)
    with pytest.raises(KeyError):
        models.enter("nowhere")


def test_a_stage_naming_an_unknown_model_raises_key_error_at_construction(impl):
    with pytest.raises(KeyError):
        impl.StagedModels({"a": Counted()}, stages={"first": ["a", "ghost"]})


def test_pinning_an_unknown_model_at_construction_raises_key_error(impl):
    with pytest.raises(KeyError):
        impl.StagedModels({"a": Counted()}, stages={"first": ["a"]}, pinned=["ghost"])


def test_close_releases_everything_loaded(impl):
    models, _ = registry(impl, pinned=["b"])
    a, b = models["a"], models["b"]
    models.close()
    assert list(models.values()) == []
    for module in (a, b):
        with pytest.raises(impl.ReleasedModuleError):
            module(torch.ones(2, 8))


# 3. ReleasedModuleError


def test_calling_a_kept_reference_after_release_names_the_model_and_the_stage(impl):
    models, _ = registry(impl)
    models.enter("first")
    kept = models["a"]
    models.enter("second")
    with pytest.raises(impl.ReleasedModuleError) as raised:
        kept(torch.ones(2, 8))
    assert raised.value.name == "a"
    assert raised.value.stage == "second"
    assert isinstance(raised.value, RuntimeError)


def test_getitem_brings_a_released_model_back_working(impl):
    models, _ = registry(impl)
    models["a"]
    models.enter("second")
    assert "a" not in [name for name, _ in models.items()]
    works(models["a"])


def test_original_calls_the_loader_again_to_bring_a_released_model_back(original):
    models, loaders = registry(original)
    models["a"]
    models.enter("second")
    again = models["a"]
    assert loaders["a"].calls == 2
    works(again)


# 4. events


def test_events_report_load_stage_and_release_with_the_model_and_its_bytes(impl):
    sink = impl.ListSink()
    models, _ = registry(impl, events=sink)
    a = models["a"]
    nbytes = storage_bytes(a)
    assert nbytes == (8 * 8 + 8) * 4
    models.enter("second")
    kinds = [event.kind for event in sink.events]
    assert {"load", "stage", "release"} <= set(kinds)
    assert kinds.index("load") < kinds.index("stage") < kinds.index("release")
    (load,) = [event for event in sink.events if event.kind == "load"]
    assert load.name == "a"
    assert load.nbytes == nbytes
    (stage,) = [event for event in sink.events if event.kind == "stage"]
    assert stage.stage == "second"
    (released,) = [event for event in sink.events if event.kind == "release"]
    assert released.name == "a"
    assert released.stage == "second"
    assert released.nbytes == nbytes


def test_events_mark_a_second_load_as_reload_and_a_load_outside_the_stage(impl):
    sink = impl.ListSink()
    models, _ = registry(impl, events=sink)
    models.enter("first")
    models["a"]
    models["b"]
    models.enter("second")
    assert models.current_stage == "second"
    models["a"]
    loads = [(e.kind, e.name, e.stage, e.note) for e in sink.events if "load" in e.kind]
    assert loads == [
        ("load", "a", "first", None),
        ("load", "b", "first", "outside_stage"),
        ("reload", "a", "second", "outside_stage"),
    ]


def test_original_release_stats_kept_counts_the_tensors_left_alone(original):
    a, b, _ = two_models_sharing_a_layer()
    assert original.release(a, keep=[b]) == original.ReleaseStats(nbytes=(8 * 8 + 8) * 4, kept=2)


def test_stageload_rs_release_stats_kept_counts_the_bytes_left_alone(stageload_rs):
    a, b, _ = two_models_sharing_a_layer()
    nbytes = (8 * 8 + 8) * 4
    assert stageload_rs.release(a, keep=[b]) == stageload_rs.ReleaseStats(nbytes, kept=nbytes)


# 5. on_call


class Greeter:
    def greet(self, who: str, punctuation: str = "!") -> str:
        return f"hello {who}{punctuation}"


def test_on_call_runs_before_with_the_args_and_after_with_the_result_and_args(impl):
    greeter = Greeter()
    seen: list[tuple] = []
    uninstall = impl.on_call(
        greeter,
        "greet",
        before=lambda *args, **kwargs: seen.append(("before", args, kwargs)),
        after=lambda result, *args, **kwargs: seen.append(("after", result, args, kwargs)),
    )
    assert greeter.greet("you", punctuation="?") == "hello you?"
    assert seen == [
        ("before", ("you",), {"punctuation": "?"}),
        ("after", "hello you?", ("you",), {"punctuation": "?"}),
    ]
    uninstall()


def test_on_call_wrappers_stack_with_the_last_installed_outermost(impl):
    greeter = Greeter()
    order: list[str] = []
    first = impl.on_call(greeter, "greet", before=lambda *a, **k: order.append("first"))
    second = impl.on_call(greeter, "greet", before=lambda *a, **k: order.append("second"))
    assert greeter.greet("you") == "hello you!"
    assert order == ["second", "first"]
    second()
    first()


def test_on_call_uninstalling_out_of_order_raises_runtime_error(impl):
    greeter = Greeter()
    first = impl.on_call(greeter, "greet", before=lambda *a, **k: None)
    second = impl.on_call(greeter, "greet", after=lambda *a, **k: None)
    with pytest.raises(RuntimeError):
        first()
    second()
    first()


def test_on_call_uninstalling_in_reverse_order_restores_a_class_method(impl):
    greeter = Greeter()
    first = impl.on_call(greeter, "greet", before=lambda *a, **k: None)
    second = impl.on_call(greeter, "greet", after=lambda *a, **k: None)
    assert "greet" in vars(greeter)
    second()
    first()
    assert "greet" not in vars(greeter)
    assert greeter.greet("you") == "hello you!"


def test_on_call_uninstalling_restores_an_instance_attribute_that_existed(impl):
    greeter = Greeter()

    def own(who: str) -> str:
        return f"hi {who}"

    greeter.greet = own
    calls: list[str] = []
    uninstall = impl.on_call(greeter, "greet", before=lambda who: calls.append(who))
    assert greeter.greet("you") == "hi you"
    assert calls == ["you"]
    uninstall()
    assert vars(greeter)["greet"] is own


def test_on_call_wraps_a_module_forward_on_that_instance_only(impl):
    wrapped, other = nn.Linear(8, 8), nn.Linear(8, 8)
    shapes: list[tuple[int, ...]] = []
    uninstall = impl.on_call(wrapped, "forward", after=lambda out, x: shapes.append(out.shape))
    wrapped(torch.ones(2, 8))
    other(torch.ones(3, 8))
    assert shapes == [(2, 8)]
    uninstall()
    assert "forward" not in vars(wrapped)


def test_on_call_with_neither_callback_raises_value_error(impl):
    with pytest.raises(ValueError):
        impl.on_call(Greeter(), "greet")


# 6. share


class Factory:
    built = 0

    @classmethod
    def build(cls, size: int, config: dict | None = None) -> nn.Module:
        Factory.built += 1
        return nn.Linear(size, size)


class Child(Factory):
    pass


def test_share_returns_one_object_for_equal_hashable_args_inside_the_block(impl):
    Factory.built = 0
    with impl.share(Factory, "build"):
        a, b = Factory.build(8), Factory.build(8)
        assert a is b
        assert Factory.built == 1
        c = Factory.build(4)
        assert c is not a
        assert Factory.built == 2
    assert Factory.build(8) is not a


def test_share_does_not_share_calls_with_unhashable_args(impl):
    Factory.built = 0
    with impl.share(Factory, "build"):
        a = Factory.build(8, config={"bias": True})
        b = Factory.build(8, config={"bias": True})
        assert a is not b
        assert Factory.built == 2


def test_share_restores_the_classmethod_descriptor_on_exit(impl):
    original = vars(Factory)["build"]
    with impl.share(Factory, "build"):
        assert vars(Factory)["build"] is not original
    assert vars(Factory)["build"] is original
    assert isinstance(Factory.build(8), nn.Linear)


def test_share_removes_an_inherited_classmethod_from_the_subclass_on_exit(impl):
    assert "build" not in vars(Child)
    with impl.share(Child, "build"):
        assert Child.build(8) is Child.build(8)
    assert "build" not in vars(Child)
    assert Child.build(8) is not Child.build(8)


def test_share_restores_the_attribute_even_when_the_block_raises(impl):
    original = vars(Factory)["build"]
    with pytest.raises(ZeroDivisionError), impl.share(Factory, "build"):
        raise ZeroDivisionError("inside the block")
    assert vars(Factory)["build"] is original


def test_share_works_on_a_module_function(impl):
    made: list[int] = []

    def make(size: int) -> nn.Module:
        made.append(size)
        return nn.Linear(size, size)

    owner = types.ModuleType("owner")
    owner.make = make
    with impl.share(owner, "make"):
        assert owner.make(8) is owner.make(8)
    assert made == [8]
    assert owner.make is make


# 7. release


def two_models_sharing_a_layer() -> tuple[nn.Module, nn.Module, nn.Linear]:
    shared = nn.Linear(8, 8)
    return nn.Sequential(shared, nn.Linear(8, 8)), nn.Sequential(shared, nn.Linear(8, 8)), shared


def test_release_frees_the_modules_own_storage_and_not_what_keep_shares(impl):
    a, b, shared = two_models_sharing_a_layer()
    own = storage_bytes(a[1])
    stats = impl.release(a, keep=[b])
    assert stats.nbytes == own
    assert storage_bytes(shared) == own
    assert storage_bytes(b) == 2 * own


def test_release_leaves_a_module_in_keep_working(impl):
    a, b, _ = two_models_sharing_a_layer()
    before = b(torch.ones(2, 8))
    impl.release(a, keep=[b])
    assert torch.equal(b(torch.ones(2, 8)), before)


def test_calling_a_released_module_raises_released_module_error(impl):
    a, b, _ = two_models_sharing_a_layer()
    impl.release(a, keep=[b])
    with pytest.raises(impl.ReleasedModuleError):
        a(torch.ones(2, 8))


def test_a_stage_change_leaves_a_model_sharing_a_layer_with_a_released_one_working(impl):
    shared = nn.Linear(8, 8)
    models = impl.StagedModels(
        {
            "a": lambda: nn.Sequential(shared, nn.Linear(8, 8)),
            "b": lambda: nn.Sequential(shared, nn.Linear(8, 8)),
        },
        stages={"first": ["a", "b"], "second": ["b"]},
    )
    models.enter("first")
    a, b = models["a"], models["b"]
    before = b(torch.ones(2, 8))
    models.enter("second")
    with pytest.raises(impl.ReleasedModuleError):
        a(torch.ones(2, 8))
    assert torch.equal(models["b"](torch.ones(2, 8)), before)


def test_release_with_name_and_stage_puts_them_in_the_error(impl):
    module = nn.Linear(8, 8)
    impl.release(module, name="encoder", stage="decode")
    with pytest.raises(impl.ReleasedModuleError) as raised:
        module(torch.ones(2, 8))
    assert (raised.value.name, raised.value.stage) == ("encoder", "decode")


def test_stageload_rs_release_frees_storage_that_an_outside_reference_still_holds(stageload_rs):
    a, b, shared = two_models_sharing_a_layer()
    own_weight, own_bias = a[1].weight, a[1].bias
    stageload_rs.release(a, keep=[b])
    assert own_weight.untyped_storage().nbytes() == 0
    assert own_bias.untyped_storage().nbytes() == 0
    assert shared.weight.untyped_storage().nbytes() == 8 * 8 * 4


def test_original_release_moves_freed_tensors_to_meta_and_leaves_kept_ones(original):
    a, b, shared = two_models_sharing_a_layer()
    original.release(a, keep=[b])
    assert a[1].weight.device.type == "meta"
    assert a[1].bias.device.type == "meta"
    assert shared.weight.device.type == "cpu"
    assert a[0] is shared


# 8. preserve_rng


def draws() -> tuple[torch.Tensor, float, float]:
    return torch.randn(4), random.random(), float(np.random.rand())


def seed() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def drawing_loader() -> nn.Module:
    random.random()
    np.random.rand()
    return nn.Linear(8, 8)


def second_draw(impl: types.ModuleType | None, preserve_rng: bool = True):
    """The second of two draws, with (``impl`` given) a model built in between."""
    seed()
    draws()
    if impl is not None:
        models = impl.StagedModels(
            {"m": drawing_loader}, stages={"s": ["m"]}, preserve_rng=preserve_rng
        )
        models["m"]
    return draws()


def test_a_load_leaves_torch_python_and_numpy_generators_where_they_were(impl):
    expected_torch, expected_python, expected_numpy = second_draw(None)
    got_torch, got_python, got_numpy = second_draw(impl)
    assert torch.equal(got_torch, expected_torch)
    assert got_python == expected_python
    assert got_numpy == expected_numpy


def test_without_preserve_rng_a_load_changes_the_next_draws(impl):
    expected_torch, expected_python, expected_numpy = second_draw(None)
    got_torch, got_python, got_numpy = second_draw(impl, preserve_rng=False)
    assert not torch.equal(got_torch, expected_torch)
    assert got_python != expected_python
    assert got_numpy != expected_numpy
