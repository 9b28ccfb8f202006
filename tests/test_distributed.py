"""Distributed evaluation: 1 process and 2 gloo processes give identical results.

The 2-process runs are real: ``torch.multiprocessing.spawn`` with a file rendezvous (no TCP port
is fixed) and ``torchrun --standalone`` (which picks a free port) for the CLI. Every metric is
compared exactly with the 1-process run on the same data; the data sets have 7 samples, which
no chunk layout splits evenly over 2 ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from explain_core.distributed import (
    EvaluationData,
    ShardSampler,
    chunk_ranges,
    evaluate,
    load_attributions,
    shard_indices,
)
from explain_core.distributed.sharding import assign_chunks, check_partition
from explain_core.distributed.store import shard_path
from explain_core.errors import DistributedError, InvalidInputError

HELPER = "dist_eval_models"

# Importable by the spawned processes: models, data and the whole comparison workload.
HELPER_SOURCE = textwrap.dedent(
    '''
    import os
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch import nn

    SHARD, BATCH = 3, 2  # chunks [0,3) [3,6) [6,7): rank 0 gets 4 samples, rank 1 gets 3


    def tiny_cnn():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(64, 10),
        ).eval()


    def tiny_caps():
        from explain_capsules import MultiLayerCapsNet

        torch.manual_seed(0)
        return MultiLayerCapsNet(
            in_features=(1, 8, 8), primary_caps=8, hidden_layers=1, hidden_caps=8, dim=4
        ).eval()


    def digits(n=7):
        from explain_core.distributed import load_dataset

        return load_dataset("digits").slice(0, n)


    def cluttered(n=7):
        from explain_core.distributed import load_dataset

        return load_dataset("cluttered", canvas_size=12, count=n)


    class FailingData:
        """Digits whose sample 3 cannot be read (it lies in rank 1's chunk)."""

        def __init__(self):
            self.data = digits()
            self.name = "failing"

        def __len__(self):
            return len(self.data)

        def slice(self, start, stop):
            if start <= 3 < stop:
                raise ValueError(f"cannot read samples {start}..{stop - 1}")
            return self.data.slice(start, stop)


    def run_all(out):
        """Every job on the same data; returns plain results (identical on every rank)."""
        from explain_core.distributed import evaluate

        out = Path(out)
        common = dict(shard_size=SHARD, batch_size=BATCH)
        cnn, data = tiny_cnn(), digits()
        results = {}
        attr = evaluate("attributions", cnn, data, method="gradient", out_dir=out / "attr",
                        **common)
        results["attributions"] = attr
        results["localisation"] = evaluate(
            "localisation", cnn, cluttered(), method="input_x_gradient", out_dir=out / "loc",
            **common,
        )
        results["pixel-removal"] = evaluate(
            "pixel-removal", cnn, data, method="gradient", removal_steps=4, **common
        )
        results["csc"] = evaluate("csc", cnn, data, method="gradient", n_vectors=3, **common)
        results["rem-dictionary"] = evaluate(
            "rem-dictionary", tiny_caps(), data, levels=11, mode="contiguous", **common
        )
        return results


    def resume(out):
        """Interrupted run: the index and one shard are gone; only that shard is recomputed."""
        from explain_core.distributed import current_context, evaluate
        from explain_core.distributed.store import shard_path

        context = current_context()
        folder = Path(out) / "attr"
        if context.rank == 0:
            (folder / "index.json").unlink()
            shard_path(folder, range(3, 6)).unlink()  # computed by rank 1
        context.barrier()
        kept = {p.name: p.stat().st_mtime_ns for p in (folder / "shards").glob("*.safetensors")}
        time.sleep(0.05)
        again = evaluate("attributions", tiny_cnn(), digits(), method="gradient",
                         out_dir=folder, shard_size=SHARD, batch_size=BATCH)
        after = {p.name: p.stat().st_mtime_ns for p in (folder / "shards").glob("*.safetensors")}
        return again, kept, after


    class HardCrash(nn.Module):
        """The tiny CNN, except that rank 1 dies without a word on its first full batch."""

        def __init__(self):
            super().__init__()
            self.net = tiny_cnn()

        def forward(self, x):
            if os.environ.get("RANK") == "1" and x.shape[0] > 2:
                os._exit(3)
            return self.net(x)


    def hard_crash():
        return HardCrash().eval()


    def unshared(out, rank):
        """Each rank writes to its own folder, as on machines without a shared filesystem."""
        from explain_core.distributed import evaluate
        from explain_core.errors import DistributedError

        try:
            evaluate("attributions", tiny_cnn(), digits(), method="gradient",
                     out_dir=Path(out) / f"unshared-{rank}", shard_size=SHARD, batch_size=BATCH)
        except DistributedError as error:
            return str(error)
        return None


    def failure(out):
        """Rank 1 fails on its first chunk; returns the error and the chunks this rank finished."""
        from explain_core.distributed import evaluate
        from explain_core.errors import DistributedError

        finished = []
        try:
            evaluate("attributions", tiny_cnn(), FailingData(), method="gradient",
                     out_dir=Path(out) / "failing", shard_size=SHARD, batch_size=BATCH,
                     progress=lambda piece, reused: finished.append(piece))
        except DistributedError as error:
            return str(error), finished
        return None, finished


    def worker(rank, world, init_file, out):
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        try:
            results = run_all(out)
            again, kept, after = resume(out)
            message, finished = failure(out)
            record = {
                "results": results, "again": again, "kept": kept, "after": after,
                "failure": message, "finished": finished, "unshared": unshared(out, rank),
            }
            torch.save(record, Path(out) / f"record-{rank}.pt")
        finally:
            dist.destroy_process_group()
    '''
)


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("helper")
    (folder / f"{HELPER}.py").write_text(HELPER_SOURCE)
    sys.path.insert(0, str(folder))
    try:
        import importlib

        importlib.invalidate_caches()
        yield importlib.import_module(HELPER), folder
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(HELPER, None)


@pytest.fixture(scope="module")
def one_process(helper, tmp_path_factory: pytest.TempPathFactory):
    module, _ = helper
    out = tmp_path_factory.mktemp("one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return module.run_all(out), out
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_processes(helper, tmp_path_factory: pytest.TempPathFactory):
    import torch.multiprocessing as mp

    module, folder = helper
    out = tmp_path_factory.mktemp("two")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), old]))
    try:
        mp.spawn(module.worker, args=(2, str(out / "rendezvous"), str(out)), nprocs=2)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old
    records = [torch.load(out / f"record-{r}.pt", weights_only=False) for r in range(2)]
    return records, out


# --- sharding without padding -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["strided", "contiguous"])
@pytest.mark.parametrize(("n", "world"), [(7, 2), (0, 3), (2, 4), (10, 3), (1, 1)])
def test_shards_partition_the_indices_without_padding(n, world, mode):
    pieces = [list(shard_indices(n, rank, world, mode)) for rank in range(world)]
    flat = sorted(i for piece in pieces for i in piece)
    assert flat == list(range(n))  # every sample exactly once
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1
    samplers = [list(ShardSampler(n, rank, world, mode)) for rank in range(world)]
    assert samplers == pieces


def test_distributed_sampler_pads_but_shard_sampler_does_not():
    data = list(range(7))
    padded = [
        list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=False)) for r in range(2)
    ]
    assert sum(map(len, padded)) == 8  # sample 0 twice
    assert sum(len(ShardSampler(7, r, 2)) for r in range(2)) == 7


def test_chunks_do_not_depend_on_the_world_size():
    chunks = chunk_ranges(7, 3)
    assert chunks == [range(0, 3), range(3, 6), range(6, 7)]
    for world in (1, 2, 3, 5):
        dealt = [c for rank in range(world) for c in assign_chunks(chunks, rank, world)]
        assert check_partition(dealt, 7) == chunks


def test_check_partition_refuses_double_counting_and_gaps():
    with pytest.raises(ValueError, match="covered twice"):
        check_partition([range(0, 4), range(3, 7)], 7)
    with pytest.raises(ValueError, match="not computed"):
        check_partition([range(0, 3), range(4, 7)], 7)
    with pytest.raises(ValueError, match="not computed"):
        check_partition([range(0, 3)], 7)
    with pytest.raises(ValueError):
        chunk_ranges(7, 0)
    with pytest.raises(ValueError):
        shard_indices(7, 2, 2)


# --- 1 process versus 2 processes, exactly ----------------------------------------------------


def test_two_processes_agree_with_each_other(two_processes):
    (first, second), _ = two_processes
    for job, result in first["results"].items():
        other = second["results"][job]
        assert result.world_size == other.world_size == 2
        assert result.summary == other.summary, job
        for key, tensor in result.per_sample.items():
            assert torch.equal(tensor, other.per_sample[key]), (job, key)


def test_attribution_shards_equal_the_single_process_maps_bitwise(one_process, two_processes):
    (results, one_out), (_, two_out) = one_process, two_processes
    single = load_attributions(one_out / "attr")
    double = load_attributions(two_out / "attr")
    assert single.attribution.shape == (7, 1, 8, 8)
    for key in ("attribution", "target", "score"):
        assert torch.equal(getattr(single, key), getattr(double, key)), key
    assert single.index["world_size"] == 1 and double.index["world_size"] == 2
    assert [(e["start"], e["stop"]) for e in double.index["shards"]] == [(0, 3), (3, 6), (6, 7)]
    assert results["attributions"].n_samples == 7


def test_localisation_scores_are_identical(one_process, two_processes):
    single = one_process[0]["localisation"]
    double = two_processes[0][0]["results"]["localisation"]
    assert single.per_sample["score"].shape == (7,)
    assert torch.equal(single.per_sample["score"], double.per_sample["score"])
    assert single.summary == double.summary
    assert single.summary["mean"] == float(single.per_sample["score"].double().mean())
    stored = json.loads((one_process[1] / "loc" / "localisation.json").read_text())
    assert stored["summary"] == single.summary and stored["n_samples"] == 7


def test_pixel_removal_curves_are_identical(one_process, two_processes):
    single = one_process[0]["pixel-removal"]
    double = two_processes[0][0]["results"]["pixel-removal"]
    assert single.per_sample["curve"].shape == (7, 5)
    assert torch.equal(single.per_sample["curve"], double.per_sample["curve"])
    assert single.summary["mean_curve"] == double.summary["mean_curve"]


def test_csc_statistics_come_from_all_cosines(one_process, two_processes):
    single = one_process[0]["csc"]
    double = two_processes[0][0]["results"]["csc"]
    assert single.details.layers == double.details.layers
    for name in single.details.layers:
        cosines = single.details.cosines[name]
        assert np.array_equal(cosines, double.details.cosines[name])
        assert single.summary["median"][name] == float(np.median(cosines))
    assert single.summary == double.summary


def test_rem_dictionary_counts_entropy_and_keys_are_identical(one_process, two_processes):
    single = one_process[0]["rem-dictionary"]
    double = two_processes[0][0]["results"]["rem-dictionary"]
    assert single.details == double.details  # every key and count of every class
    assert torch.equal(single.details.entropy(), double.details.entropy())
    assert torch.equal(single.details.keys_per_class(), double.details.keys_per_class())
    assert int(double.details.samples_per_class().sum()) == 7  # no sample counted twice
    assert single.summary == double.summary
    assert torch.equal(single.per_sample["predicted"], double.per_sample["predicted"])


# --- resumable attribution shards -------------------------------------------------------------


def test_interrupted_two_process_run_recomputes_only_the_missing_shard(one_process, two_processes):
    (record, _), out = two_processes
    again, kept, after = record["again"], record["kept"], record["after"]
    assert again.computed == (range(3, 6),)
    assert again.reused == (range(0, 3), range(6, 7))
    assert set(kept) < set(after)
    assert all(after[name] == mtime for name, mtime in kept.items())  # not rewritten
    assert (out / "attr" / "index.json").is_file()
    expected = load_attributions(one_process[1] / "attr").attribution
    assert torch.equal(load_attributions(out / "attr").attribution, expected)


def test_interrupted_single_process_run_resumes(helper, one_process, tmp_path):
    module, _ = helper
    model, data = module.tiny_cnn(), module.digits()
    done: list[range] = []

    def interrupt(piece: range, reused: bool) -> None:
        done.append(piece)
        if len(done) == 2:
            raise KeyboardInterrupt  # the run stops after two shards

    options = dict(method="gradient", out_dir=tmp_path, shard_size=3, batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        evaluate("attributions", model, data, progress=interrupt, **options)
    assert not (tmp_path / "index.json").exists()
    # A torn write leaves only a temporary file, never a partial shard.
    (tmp_path / "shards" / ".shard-000000006-000000007.safetensors-tmp").write_bytes(b"torn")
    result = evaluate("attributions", model, data, **options)
    assert result.reused == (range(0, 3), range(3, 6))
    assert result.computed == (range(6, 7),)
    expected = load_attributions(one_process[1] / "attr").attribution
    assert torch.equal(load_attributions(tmp_path).attribution, expected)


def test_invalid_or_foreign_shards_are_recomputed(helper, tmp_path):
    module, _ = helper
    model, data = module.tiny_cnn(), module.digits()
    options = dict(method="gradient", out_dir=tmp_path, shard_size=3, batch_size=2)
    first = evaluate("attributions", model, data, **options)
    assert first.reused == ()
    shard_path(tmp_path, range(3, 6)).write_bytes(b"not a safetensors file")
    second = evaluate("attributions", model, data, **options)
    assert second.computed == (range(3, 6),)
    # Another method: every shard belongs to another run.
    third = evaluate("attributions", model, data, **{**options, "method": "input_x_gradient"})
    assert third.reused == () and len(third.computed) == 3
    # A shard edited after the index was written is caught when loading.
    shard_path(tmp_path, range(0, 3)).write_bytes(b"changed")
    with pytest.raises(DistributedError, match="changed"):
        load_attributions(tmp_path)


def _attribution_bytes(path: Path) -> slice:
    """Where the ``attribution`` tensor's bytes lie in a shard file."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + length])["attribution"]["data_offsets"]
    return slice(8 + length + begin, 8 + length + end)


def test_a_shard_corrupted_on_disk_is_recomputed(helper, one_process, tmp_path):
    module, _ = helper
    model, data = module.tiny_cnn(), module.digits()
    options = dict(method="gradient", out_dir=tmp_path, shard_size=3, batch_size=2)
    evaluate("attributions", model, data, **options)
    path = shard_path(tmp_path, range(3, 6))
    corrupted = bytearray(path.read_bytes())
    where = _attribution_bytes(path)
    corrupted[where.start : where.start + 4] = b"\x00\x00\xc0\x7f"  # one map value -> NaN
    corrupted[where.stop - 4 : where.stop] = b"\xff\xff\x7f\x7f"  # the last -> 3.4e38
    path.write_bytes(bytes(corrupted))
    again = evaluate("attributions", model, data, **options)
    assert again.computed == (range(3, 6),)
    assert again.reused == (range(0, 3), range(6, 7))
    stored = load_attributions(tmp_path)
    assert torch.isfinite(stored.attribution).all()
    expected = load_attributions(one_process[1] / "attr")
    for key in ("attribution", "target", "score"):
        assert torch.equal(getattr(stored, key), getattr(expected, key)), key


def test_identical_runs_write_identical_files(helper, tmp_path):
    module, _ = helper
    model, data = module.tiny_cnn(), module.digits()
    options = dict(method="gradient", shard_size=2, batch_size=2)  # 4 shards per run
    for name in ("a", "b"):
        evaluate("attributions", model, data, out_dir=tmp_path / name, **options)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.*"))
    assert len(files) == 5  # index.json and 4 shards
    for file in files:
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def test_another_batch_size_recomputes_every_shard(helper, tmp_path):
    module, _ = helper
    model, data = module.tiny_cnn(), module.digits()
    options = dict(method="gradient", out_dir=tmp_path, shard_size=3)
    evaluate("attributions", model, data, batch_size=2, **options)
    assert json.loads((tmp_path / "index.json").read_text())["batch_size"] == 2
    again = evaluate("attributions", model, data, batch_size=3, **options)
    assert again.reused == () and len(again.computed) == 3
    assert json.loads((tmp_path / "index.json").read_text())["batch_size"] == 3


def test_an_output_folder_that_is_not_shared_is_refused(two_processes):
    (first, second), out = two_processes
    assert "does not exist on rank 0" in first["unshared"]
    assert "shards/shard-000000003-000000006.safetensors that rank 1" in first["unshared"]
    assert "rank 0 could not write the results" in second["unshared"]
    for record in (first, second):
        assert "every rank can see" in record["unshared"]
    assert not (out / "unshared-0" / "index.json").exists()


def test_a_failure_on_one_rank_reaches_every_rank(two_processes):
    (first, second), _ = two_processes
    for record in (first, second):
        assert record["failure"] is not None
        assert "rank 1" in record["failure"] and "cannot read samples" in record["failure"]
        assert "rank 0" not in record["failure"]
    # Rank 0 stops after the round in which rank 1 failed: [6, 7) is never computed.
    assert first["finished"] == [range(0, 3)] and second["finished"] == []


def test_a_second_run_into_the_same_folder_is_refused_while_the_first_runs(helper, tmp_path):
    module, _ = helper
    options = dict(method="gradient", shard_size=3, batch_size=2, out_dir=tmp_path)
    holder = subprocess.Popen(  # another run, holding the folder's lock
        [sys.executable, "-c", (
            "import sys, time; from pathlib import Path\n"
            "from explain_core.distributed.lock import OutputLock\n"
            "lock = OutputLock(Path(sys.argv[1])); lock.acquire()\n"
            "print('held', flush=True); time.sleep(60)"
        ), str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DistributedError, match=r"another run is writing into .*process \d+"):
            evaluate("attributions", module.tiny_cnn(), module.digits(), **options)
        assert not (tmp_path / "shards").exists()  # refused before computing anything
    finally:
        holder.kill()  # killed, as a crashed run is: the OS releases its lock
        holder.wait()
    result = evaluate("attributions", module.tiny_cnn(), module.digits(), **options)
    assert len(result.computed) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json", "shards"]  # no lock left


def test_shards_the_index_no_longer_lists_are_removed(helper, tmp_path):
    module, _ = helper
    options = dict(method="gradient", batch_size=2, out_dir=tmp_path)
    evaluate("attributions", module.tiny_cnn(), module.digits(), shard_size=2, **options)
    (tmp_path / "shards" / "notes.txt").write_text("the user's own file")
    evaluate("attributions", module.tiny_cnn(), module.digits(), shard_size=3, **options)
    listed = {e["file"] for e in json.loads((tmp_path / "index.json").read_text())["shards"]}
    on_disk = {p.relative_to(tmp_path).as_posix() for p in (tmp_path / "shards").iterdir()}
    assert on_disk == listed | {"shards/notes.txt"}
    assert len(listed) == 3  # [0,3) [3,6) [6,7); the four shards of size 2 are gone
    stored = load_attributions(tmp_path)
    assert stored.attribution.shape[0] == 7


# --- API errors -------------------------------------------------------------------------------


def test_evaluate_errors(helper, tmp_path):
    module, _ = helper
    model, data = module.tiny_cnn(), module.digits()
    with pytest.raises(InvalidInputError, match="unknown job"):
        evaluate("saliency", model, data, method="gradient")
    with pytest.raises(InvalidInputError, match="needs a method"):
        evaluate("localisation", model, module.cluttered())
    with pytest.raises(InvalidInputError, match="masks"):
        evaluate("localisation", model, data, method="gradient")
    with pytest.raises(InvalidInputError, match="out_dir"):
        evaluate("attributions", model, data, method="gradient")
    with pytest.raises(InvalidInputError, match="no option"):
        evaluate("csc", model, data, method="gradient", bogus=1)
    with pytest.raises(InvalidInputError, match="takes no attribution method"):
        evaluate("rem-dictionary", model, data, method="gradient")
    tensors = EvaluationData(data.inputs, data.labels)
    result = evaluate(
        "pixel-removal",
        model,
        (tensors.inputs, tensors.labels),
        method="gradient",
        removal_steps=2,
        shard_size=7,
        batch_size=7,
    )
    assert result.per_sample["curve"].shape == (7, 3)


# --- the CLI under torchrun -------------------------------------------------------------------


def test_cli_under_torchrun_matches_one_process(helper, tmp_path, capsys):
    from safetensors.torch import save_file

    from explain_core.cli import main

    module, folder = helper
    save_file(module.tiny_cnn().state_dict(), str(tmp_path / "w.safetensors"))
    args = [
        "evaluate", "--model", f"{HELPER}:tiny_cnn", "--weights", str(tmp_path / "w.safetensors"),
        "--dataset", "cluttered", "--canvas-size", "12", "--count", "7", "--job",
        "localisation", "--method", "gradient", "--batch-size", "2", "--shard-size", "3",
        "--threads", "1",
    ]  # fmt: skip
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun comes with torch"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}
    env.pop("OMP_NUM_THREADS", None)
    process = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", "-m", "explain_core", *args,
         "--out", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.count("localisation (gradient): 7 samples on 2 process(es)") == 1
    threads = torch.get_num_threads()
    try:
        assert main([*args, "--out", str(tmp_path / "one")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "on 1 process(es)" in capsys.readouterr().out
    one = json.loads((tmp_path / "one" / "localisation.json").read_text())
    two = json.loads((tmp_path / "two" / "localisation.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["summary"] == two["summary"]
    from safetensors.torch import load_file

    scores = [load_file(str(tmp_path / d / "localisation.safetensors")) for d in ("one", "two")]
    assert torch.equal(scores[0]["score"], scores[1]["score"])


def test_cli_reports_a_rank_that_died_in_one_line(helper, tmp_path):
    _, folder = helper
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(
            """
            import os, sys
            import torch.distributed as dist
            from explain_core.cli import main

            rank = int(os.environ["RANK"])
            dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank,
                                    world_size=2)
            sys.exit(main(sys.argv[2:]))
            """
        )
    )
    args = [
        "evaluate", "--model", f"{HELPER}:hard_crash", "--dataset", "digits", "--limit", "7",
        "--job", "attributions", "--method", "gradient", "--batch-size", "3",
        "--shard-size", "3", "--threads", "1", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path]),
           "WORLD_SIZE": "2"}  # fmt: skip
    command = [sys.executable, str(driver), str(tmp_path / "rendezvous"), *args]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    processes = [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, **pipes)
        for r in range(2)
    ]
    (_, err0), (_, _) = (p.communicate(timeout=120) for p in processes)
    assert processes[1].returncode == 3  # it died hard, saying nothing
    assert processes[0].returncode == 1
    lines = err0.strip().splitlines()
    assert len(lines) == 1, err0[-3000:]
    assert lines[0].startswith("explain: error: another rank stopped while rank 0 was waiting")


def test_cli_size_errors_name_the_option_once_per_machine(monkeypatch, capsys):
    from explain_core.cli import main

    argv = ["evaluate", "--model", "x:y", "--dataset", "digits", "--job", "attributions",
            "--method", "gradient", "--out", "o"]  # fmt: skip
    for option in ("--shard-size", "--batch-size"):
        with pytest.raises(SystemExit) as stop:
            main([*argv, option, "0"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1
        assert f"argument {option}: expected an int >= 1" in err
    # Under torchrun every process parses the command line; one message per machine is enough.
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--shard-size", "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ""


def test_cli_usage_errors(capsys):
    from explain_core.cli import main

    code = main(["evaluate", "--model", "x:y", "--dataset", "digits", "--job", "csc",
                 "--out", "o"])  # fmt: skip
    assert code == 1
    assert "needs --method" in capsys.readouterr().err
