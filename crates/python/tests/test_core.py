"""What the Rust core does for Python modules: release in place with the memory given back to
the OS, reload bit for bit into the same objects, generators restored, loader errors, changed
files, bad input, prefetch, snapshots and traces."""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import stageload_rs as sl
import torch
from conftest import Counted, mapped_from, mlp, rss_bytes, storage_bytes
from safetensors.torch import save_file, save_model
from torch import nn


def staged(loaders, **options):
    """Two stages, ``a`` and ``b``, listing the first and the second model."""
    names = list(loaders)
    return sl.StagedModels(loaders, stages={"a": names[:1], "b": names[1:]}, **options)


def test_a_reload_refills_the_same_module_objects_bit_for_bit(saved):
    first = mlp()
    loader = Counted(lambda: mlp())
    models = staged(
        {"m": loader, "other": mlp},
        checkpoints={"m": [saved("m", first)]},
    )
    models.enter("a")
    module = models["m"]
    parameters = {name: (id(p), p.detach().clone()) for name, p in module.named_parameters()}
    x = torch.randn(3, 16)
    before = module(x)
    weight = module[0].weight
    models.enter("b")
    assert weight.untyped_storage().nbytes() == 0, "the release frees the storage in place"
    models.enter("a")
    again = models["m"]
    assert again is module and loader.calls == 1, "same object, no second build"
    for name, p in again.named_parameters():
        assert id(p) == parameters[name][0]
        assert torch.equal(p, parameters[name][1]), name
    assert torch.equal(first[0].weight, again[0].weight), (
        "the checkpoint's values, not the loader's"
    )
    assert torch.equal(again(x), before)
    assert models.load_report("m")["used"] == 4, "the four tensors, each from its entry"


def test_a_release_gives_the_memory_back_to_the_os_while_references_live(saved):
    big = nn.Linear(4096, 4096)  # 64 MiB of weights
    covered = storage_bytes(big)
    models = staged({"big": lambda: big, "other": mlp}, checkpoints={"big": [saved("big", big)]})
    models.enter("a")
    module = models["big"]
    outside = module.weight  # a reference the pipeline keeps
    before = rss_bytes()
    models.enter("b")
    after = rss_bytes()
    # What else the release path allocates meanwhile (the event, the hooks of two modules) is far
    # below a quarter of the storage, and below a MiB.
    slack = min(1 << 20, covered // 4)
    assert before - after >= covered - slack, (before, after, covered)
    assert outside.untyped_storage().nbytes() == 0


def test_tied_weights_are_one_storage_freed_once_and_tied_after_a_reload(tmp_path):
    def tied() -> nn.Module:
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32, bias=False))
        model[1].weight = model[0].weight
        return model

    first = tied()
    path = tmp_path / "tied.safetensors"
    save_model(first, str(path))  # the ordinary way: one entry for the tied pair
    events = sl.ListSink()
    models = staged(
        {"m": tied, "other": mlp},
        checkpoints={"m": [path]},
        events=events,
    )
    models.enter("a")
    module = models["m"]
    models.enter("b")
    (released,) = [e for e in events.of_kind("release") if e.name == "m"]
    assert released.nbytes == 32 * 16 * 4, "one storage, counted once"
    models.enter("a")
    module = models["m"]
    assert module[1].weight is module[0].weight
    assert torch.equal(module[0].weight, first[0].weight)


@pytest.mark.parametrize("preserve", [True, False])
def test_a_build_leaves_torch_python_and_numpy_generators_as_they_were(preserve):
    def drawing() -> nn.Module:
        random.random()
        np.random.rand()
        return nn.Linear(64, 64)  # torch's initialisation draws too

    def draws() -> tuple[float, float, torch.Tensor]:
        return random.random(), float(np.random.rand()), torch.randn(4)

    def seed() -> None:
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)

    seed()
    draws()
    expected = draws()
    models = staged({"m": drawing, "other": mlp}, preserve_rng=preserve)
    seed()
    draws()
    models.enter("a")
    models["m"]
    got = draws()
    same = [got[0] == expected[0], got[1] == expected[1], torch.equal(got[2], expected[2])]
    # the control: without preserving, each generator has moved
    assert same == ([True] * 3 if preserve else [False] * 3)


def test_a_loader_that_raises_is_a_loader_error_naming_the_model_and_the_registry_goes_on():
    calls = []

    def flaky() -> nn.Module:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("weights not there yet")
        return mlp()

    models = staged({"m": flaky, "other": mlp})
    models.enter("a")
    with pytest.raises(sl.LoaderError, match="'m'") as raised:
        models["m"]
    assert raised.value.model == "m"
    assert isinstance(raised.value.__cause__, ValueError)
    assert models.states()["m"] == "failed"
    assert models["other"](torch.randn(1, 16)).shape == (1, 4), "another model still loads"
    assert models["m"](torch.randn(1, 16)).shape == (1, 4), "asking again runs the loader again"


def test_a_release_collects_while_an_object_in_a_cycle_keeps_the_models_file_mapped(
    saved, collections
):
    path = saved("m", mlp())
    real = str(path.resolve())

    def held_in_a_cycle() -> nn.Module:
        # the file mapped (privately, as from_pretrained maps it) by an object in a cycle, which
        # is garbage once the loader returns
        cycle = {"view": torch.from_file(str(path), size=path.stat().st_size, dtype=torch.uint8)}
        cycle["self"] = cycle
        return mlp()

    models = staged({"m": held_in_a_cycle, "other": mlp}, checkpoints={"m": [path]})
    gc.disable()  # no automatic collection between the load and the release
    try:
        models.enter("a")
        models["m"]
        assert real in Path("/proc/self/maps").read_text()
        models.enter("b")
        assert collections == [1]
        assert real not in Path("/proc/self/maps").read_text()
        models.enter("a")
        models["m"]  # refilled by the registry: nothing of Python's maps it
        models.enter("b")
        assert collections == [1]
    finally:
        gc.enable()


def test_python_loaders_run_one_at_a_time_a_prefetchs_beside_the_foregrounds(saved):
    """The core lets a prefetch's build run its loader beside a foreground build; Python's
    loaders (from_pretrained patches process-wide state while it builds) wait for each other."""
    order = []
    started = threading.Event()

    def slow() -> nn.Module:
        started.set()
        order.append("other starts")
        time.sleep(0.3)  # the foreground's load is asked for meanwhile
        order.append("other ends")
        return mlp()

    def quick() -> nn.Module:
        order.append("m runs")
        return mlp()

    models = staged(
        {"m": quick, "other": slow},
        checkpoints={"m": [saved("m", mlp())], "other": [saved("other", mlp())]},
        skip_init=["m", "other"],
        prefetch=True,
    )
    models.enter("a")  # starts building "other" (stage b) in the background
    assert started.wait(10), "the prefetch's loader ran"
    models["m"]
    models.wait_prefetch("b")
    assert order == ["other starts", "other ends", "m runs"]
    models.close()


def test_a_loader_that_leaves_weights_on_meta_is_a_loader_error_naming_them(saved):
    """As transformers' from_pretrained does when filling a weight fails: it logs, and the weight
    stays on meta (the check of the checkpoint would call it released)."""

    def unloaded() -> nn.Module:
        module = mlp()
        with torch.device("meta"):
            module[2] = nn.Linear(16, 4)
        return module

    models = staged({"m": unloaded, "other": mlp}, checkpoints={"m": [saved("m", mlp())]})
    models.enter("a")
    with pytest.raises(sl.LoaderError) as raised:
        models["m"]
    assert raised.value.model == "m"
    assert "returned 2 of its 4 weights on the meta device" in str(raised.value)
    assert "('2.weight' first)" in str(raised.value)
    assert models.states()["m"] == "failed"
    assert models["other"](torch.randn(1, 16)).shape == (1, 4), "another model still loads"


def test_a_keyboard_interrupt_during_a_load_comes_through_and_leaves_nothing_filled(saved):
    """A real SIGINT, sent by another thread while the loader runs (the loader waits for it)."""
    started = threading.Event()
    interrupted = []

    def slow() -> nn.Module:
        started.set()
        try:
            threading.Event().wait(10)  # the deadline: the signal comes long before
        except KeyboardInterrupt:
            interrupted.append(True)
            raise
        return mlp()

    def interrupt() -> None:
        if started.wait(10):
            os.kill(os.getpid(), signal.SIGINT)

    models = staged({"m": slow, "other": mlp}, checkpoints={"m": [saved("m", mlp())]})
    models.enter("a")
    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        models["m"]
    sender.join(10)
    assert interrupted == [True], "the interrupt came inside the loader"
    assert models.states()["m"] == "failed"
    assert models.loaded() == []


def test_file_reads_and_copies_run_with_the_gil_released(saved, tmp_path):
    """Another Python thread runs while the checkpoint fills the model: it sees the load going."""
    big = nn.Linear(8192, 4096)  # 128 MiB
    models = staged(
        {"big": lambda: nn.Linear(8192, 4096), "other": mlp},
        checkpoints={"big": [saved("big", big)]},
    )
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.add(models.states()["big"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    models.enter("a")
    models.load("big")
    done.set()
    watcher.join(10)
    assert "loading" in seen, seen


def test_a_changed_checkpoint_is_refused_and_accepting_it_takes_the_new_values(tmp_path, saved):
    path = saved("m", mlp())
    models = staged({"m": mlp, "other": mlp}, checkpoints={"m": [path]})
    models.enter("a")
    module = models["m"]
    models.enter("b")
    newer = mlp()
    save_file(
        {k: v.contiguous() for k, v in newer.state_dict().items()},
        str(tmp_path / "new.safetensors"),
    )
    os.replace(tmp_path / "new.safetensors", path)
    models.enter("a")
    with pytest.raises(sl.SourceChangedError) as raised:
        models["m"]
    assert (raised.value.model, Path(raised.value.path)) == ("m", path)
    with pytest.raises(sl.ReleasedModuleError):
        module(torch.randn(1, 16))
    models.accept_changed_files("m")
    assert torch.equal(models["m"][0].weight, newer[0].weight)


def test_a_model_that_maps_comes_back_on_its_files_pages_bit_for_bit(saved):
    first = mlp()
    path = saved("m", first)
    events = sl.ListSink()
    models = staged(
        {"m": mlp, "other": mlp},
        checkpoints={"m": [path]},
        reload_mapped=["m"],
        events=events,
    )
    models.enter("a")
    module = models["m"]
    x = torch.randn(3, 16)
    before = module(x)
    assert not mapped_from(module[0].weight, path), "the first load copies"
    models.enter("b")
    models.enter("a")
    assert models["m"] is module
    assert torch.equal(module(x), before)
    assert all(mapped_from(p, path) for p in module.parameters()), "the file's own pages"
    assert [e.fields.get("from") for e in events.of_kind("reload")] == ["mapped"]


def test_a_file_written_in_place_under_a_mapped_model_releases_it_before_any_use(saved):
    path = saved("m", mlp())
    models = staged({"m": mlp, "other": mlp}, checkpoints={"m": [path]}, reload_mapped=["m"])
    models.enter("a")
    models["m"]
    models.enter("b")
    models.enter("a")
    module = models["m"]
    with open(path, "r+b") as file:  # new values over the last weight, in place
        file.seek(-4, os.SEEK_END)
        file.write(b"\x00\x00\x80\x7f")
    with pytest.raises(sl.ChangedUnderModelError) as raised:
        models["m"]
    assert (raised.value.model, Path(raised.value.path)) == ("m", path)
    assert isinstance(raised.value, sl.SourceChangedError)
    assert models.states()["m"] == "released"
    with pytest.raises(sl.ReleasedModuleError):
        module(torch.randn(1, 16))
    with pytest.raises(sl.SourceChangedError):
        models["m"]


def test_a_checkpoint_that_does_not_fit_names_the_model_and_the_tensor(saved):
    wrong = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    models = staged({"m": mlp, "other": mlp}, checkpoints={"m": [saved("m", wrong)]})
    models.enter("a")
    with pytest.raises(sl.StageError, match=r"'m'.*0\.weight"):
        models["m"]


def test_bad_names_and_files_are_refused_with_what_to_do(tmp_path):
    with pytest.raises(KeyError) as unknown:
        staged({"m": mlp, "other": mlp}).enter("c")
    assert unknown.value.args[0].startswith("unknown stage 'c'; known stages:")
    with pytest.raises(KeyError, match="nope"):
        staged({"m": mlp, "other": mlp})["nope"]
    with pytest.raises(FileNotFoundError, match="'m'.*missing.safetensors"):
        staged({"m": mlp, "other": mlp}, checkpoints={"m": [tmp_path / "missing.safetensors"]})
    with pytest.raises(ValueError, match="give it checkpoints="):
        staged({"m": mlp, "other": mlp}, skip_init=["m"])
    models = staged({"m": lambda: "not a module", "other": mlp})
    with pytest.raises(sl.LoaderError, match="returned a str, not a torch.nn.Module"):
        models["m"]


def test_another_torch_version_is_refused_at_import_in_one_line():
    code = "import torch; torch.__version__ = '2.12.1'; import stageload_rs"
    run = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: stageload_rs was built for torch 2.13.0, and this is torch 2.12.1"
    )


def test_prefetch_brings_the_next_stage_back_in_the_background_bit_for_bit(saved):
    first, second = mlp(), mlp()
    events = sl.ListSink()
    models = staged(
        {"m": mlp, "n": mlp},
        checkpoints={"m": [saved("m", first)], "n": [saved("n", second)]},
        prefetch=True,
        events=events,
    )
    models.enter("a")
    models["m"]
    models.enter("b")
    models["n"]
    models.enter("a")  # "b" comes next: n, released now, is refilled in the background
    assert models.stage_models("b") == ["n"]
    models.wait_prefetch("b")
    assert models.prefetching() == []
    (reload,) = [e for e in events.of_kind("reload") if e.name == "n"]
    assert reload.fields.get("prefetched") is True
    models.enter("b")
    assert torch.equal(models["n"][0].weight, second[0].weight)


# A prefetch's loader, in the middle of torch calls (each gives up the GIL) for a second and a
# half when the script goes on; what the script does then follows it.
PREFETCH_IN_A_TORCH_CALL = """
import sys, threading, time
import stageload_rs as sl, torch
from torch import nn
from safetensors.torch import save_file

save_file(nn.Linear(4, 4).state_dict(), sys.argv[1])
started = threading.Event()

def busy():
    started.set()
    x, end = torch.ones(500, 500), time.monotonic() + 1.5
    while time.monotonic() < end:
        x = x @ x / 500
    print("the loader ended", flush=True)
    return nn.Linear(4, 4)

models = sl.StagedModels(
    {"a": lambda: nn.Linear(4, 4), "b": busy}, stages={"one": ["a"], "two": ["b"]},
    checkpoints={"b": [sys.argv[1]]}, loader_reads_checkpoint=["b"], prefetch=True,
)
models.enter("one")
assert started.wait(30) and models.prefetching() == ["b"]
"""


def run_script(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "b.safetensors")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_process_exits_cleanly_while_a_prefetch_runs_a_torch_call(tmp_path):
    """Without the exit's wait the interpreter stopped the prefetch's thread inside torch, and
    the process aborted ("terminate called without an active exception", exit 134)."""
    run = run_script(PREFETCH_IN_A_TORCH_CALL + "print('exits', flush=True)\n", tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["exits", "the", "loader", "ended"], "the exit waited for it"
    assert "terminate" not in run.stderr


def test_dropping_the_models_while_a_prefetch_runs_its_loader_waits_for_it(tmp_path):
    """The drop joins the prefetch's thread, whose loader needs the GIL: held by the drop, both
    waited for ever (the deadline here is the subprocess's)."""
    code = PREFETCH_IN_A_TORCH_CALL + "del models\nprint('dropped', flush=True)\n"
    run = run_script(code, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["the", "loader", "ended", "dropped"]


def test_a_host_tier_holds_no_cpu_model_says_so_and_the_reload_reads_the_checkpoint(saved):
    first = mlp()
    events = sl.ListSink()
    models = staged(
        {"m": mlp, "other": mlp},
        checkpoints={"m": [saved("m", first)]},
        host_tier=1 << 30,
        events=events,
    )
    for _ in range(2):
        models.enter("a")
        models["m"]
        models.enter("b")
    (tier,) = events.of_kind("tier")  # said once, at the first release
    assert (tier.name, tier.fields["action"]) == ("m", "not_stored")
    assert "CPU" in tier.fields["detail"]
    assert tier.fields["tier"] == {"budget": 1 << 30, "used": 0}
    models.enter("a")
    assert torch.equal(models["m"][0].weight, first[0].weight)
    assert {e.fields.get("from") for e in events.of_kind("reload")} == {"in_place"}


def test_a_model_without_a_checkpoint_comes_back_from_its_snapshot(tmp_path):
    loader = Counted(mlp)
    events = sl.ListSink()
    models = staged({"m": loader, "other": mlp}, snapshots=tmp_path / "snapshots", events=events)
    models.enter("a")
    module = models["m"]
    values = module[0].weight.detach().clone()
    models.enter("b")
    models.enter("a")
    assert models["m"] is module and loader.calls == 1
    assert torch.equal(module[0].weight, values)
    assert [e.fields.get("from") for e in events.of_kind("reload")] == ["snapshot"]


def test_the_memory_meter_writes_a_trace_the_cli_summarises(tmp_path, saved):
    trace = tmp_path / "run.jsonl"
    with sl.MemoryMeter(trace, interval=0.05, meta={"mode": "staged"}) as meter:
        models = staged({"m": mlp, "n": mlp}, events=meter)
        for stage, name in (("a", "m"), ("b", "n")):
            models.enter(stage)
            models[name](torch.randn(2, 16))
        models.close()
    stages = [s["stage"] for s in meter.summary()["stages"]]
    assert stages[-2:] == ["a", "b"], stages
    cli = os.environ.get("STAGELOAD_CLI")
    assert cli, "STAGELOAD_CLI names the stageload binary (cargo xtask test sets it)"
    shown = subprocess.run(
        [cli, "summary", str(trace)], check=False, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert "a" in shown.stdout and "b" in shown.stdout
