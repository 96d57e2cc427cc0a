"""``ampkit doctor``: the report as tables, strict JSON, the plot, and bad input (exit 2).

The runs call ``main()`` in-process on tiny models (one subprocess, a slow test, runs the
command as a user would).
``doctor_models`` is a user module, written once to a temporary folder on ``sys.path``:
``hot`` overflows fp16 in layer '2' (its weights are 1e5 times too large: finite in fp32
and bf16), ``halved`` returns an fp16 model (refused: the model must be the fp32 one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ampkit
from ampkit.cli import main
from ampkit.cli.doctor import resolve_policy_name

SRC = str(Path(ampkit.__file__).resolve().parent.parent)
HAS_MATPLOTLIB = __import__("importlib").util.find_spec("matplotlib") is not None
MODULE = "doctor_models_for_tests"
SOURCE = '''
import torch
from torch import nn

def hot():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32),
                          nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.mul_(1e5)  # its outputs pass fp16's 65504: inf under 16-mixed
    return model, (torch.randn(8, 16), torch.randint(0, 4, (8,)))

def halved():
    return nn.Linear(4, 2).half(), (torch.randn(3, 4), torch.randn(3, 2))

class Broken(nn.Linear):
    def forward(self, x):
        raise ValueError("bad shape inside my model")

def broken():
    return Broken(4, 2), (torch.randn(3, 4), torch.randn(3, 2))

class Pair(nn.Linear):
    def forward(self, x):
        return super().forward(x), x.sum()

def pair():
    return Pair(4, 2), (torch.randn(3, 4), torch.randint(0, 2, (3,)))

def unseeded():
    return nn.Linear(4, 2), (torch.randn(3, 4), torch.randn(3, 2))

def sized(batch_size=0):
    return nn.Linear(4, 2), (torch.randn(batch_size, 4), torch.randn(batch_size, 2))

SEEN_TRAINING = []

class Recorder(nn.Linear):
    def forward(self, x):
        SEEN_TRAINING.append(self.training)
        return super().forward(x)

def eval_backbone():
    model = nn.Sequential(Recorder(4, 4), nn.Linear(4, 2))
    model[0].eval()
    return model, (torch.randn(3, 4), torch.randn(3, 2))
'''


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("doctor_models")
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    return folder


@pytest.fixture
def user_models(models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.syspath_prepend(str(models_dir))
    return MODULE


def strict(text: str) -> dict:
    """json.loads that fails on Infinity/NaN (not JSON, though Python writes them)."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")
    return json.loads(text, parse_constant=refuse)


def table_rows(out: str) -> list[list[str]]:
    """The cells of each data row of the module table (rich boxes, or plain text)."""
    if "│" in out:
        return [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()
                if line.startswith("│") and re.match(r"│\s*\d+\s*│", line)]
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "module"])
    rows = []
    for line in lines[start + 1:]:
        if not line[:1].isspace() and not line[:1].isdigit():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def usage_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """main() in-process: exit 2, one line on stderr, nothing on stdout; that line."""
    assert main(["doctor", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == ""  # refused before any work
    return lines[0]


# --- a layer that overflows fp16 ---------------------------------------------------------------
def test_doctor_names_the_layer_that_overflows_fp16(capsys, tmp_path, user_models):
    path = tmp_path / "hot.json"
    assert main(["doctor", "--model", f"{user_models}:hot", "--policy", "16-mixed",
                 "--json", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "first non-finite: module '2', its output in the forward pass" in out
    worst = table_rows(out)[0]  # worst first: '2', the first non-finite, with -inf SQNR
    assert worst[:3] == ["2", "2", "Linear"] and worst[4] == "-inf" and worst[-1] == "yes"
    assert "ampkit.keep_fp32(model, ['2'])" in out and "'bf16-mixed'" in out
    assert "low-precision share: 100.0% of the FLOPs ran below fp32" in out

    doc = strict(path.read_text())
    assert doc["command"] == "doctor" and doc["environment"]["device"] == "cpu"
    assert doc["first_nonfinite"] == ["forward", "2"] and doc["policy"] == "16-mixed"
    hot = doc["modules"][2]
    assert hot["name"] == "2" and hot["overflow"] > 0 and hot["nonfinite"] is True
    assert hot["out_sqnr_db"] == "-inf" and doc["policy_loss"] == "nan"  # strict JSON
    first = doc["modules"][0]  # before the overflow: its output is fine (its gradient is not)
    assert first["overflow"] == 0.0 and first["out_sqnr_db"] > 40 and first["grad_sqnr_db"] == "-inf"
    assert set(doc["flops"]) == {"float16"} and doc["low_precision_share"] == 1.0
    assert doc["settings"]["resolved_policy"] == "16-mixed"


def test_the_same_model_is_finite_in_bf16(capsys, tmp_path, user_models):
    path = tmp_path / "bf16.json"
    assert main(["doctor", "--model", f"{user_models}:hot", "--policy", "bf16-mixed",
                 "--json", str(path), "--quiet", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "first non-finite: none" in out and "(+4 more: --top 0 shows all" in out
    assert len(table_rows(out)) == 2
    doc = strict(path.read_text())
    assert doc["first_nonfinite"] is None and len(doc["modules"]) == 6
    assert all(m["overflow"] == 0.0 and not m["nonfinite"] for m in doc["modules"])


def test_seed_decides_a_user_functions_random_weights_and_batch(capsys, tmp_path, user_models):
    losses = []
    for earlier in (1, 2):  # whatever ran before the command left the RNG here
        torch.manual_seed(earlier)
        path = tmp_path / f"after_{earlier}.json"
        assert main(["doctor", "--model", f"{user_models}:unseeded", "--seed", "7",
                     "--json", str(path), "--quiet"]) == 0
        losses.append(strict(path.read_text())["ref_loss"])
    assert losses[0] == losses[1]


def test_policy_names_mean_what_bench_takes(capsys):
    assert resolve_policy_name("O2", "cpu") == "O2-bf16"  # the CPU's autocast dtype, as bench
    assert resolve_policy_name("O1-fp16", "cpu") == "O1-fp16"
    assert resolve_policy_name("O0", "cpu") == "O0"
    assert resolve_policy_name("fp8", "cpu") == "fp8-tensorwise"
    assert resolve_policy_name("p=f32,c=bf16,o=f32", "cpu") == "p=f32,c=bf16,o=f32"
    assert resolve_policy_name(None, "cpu") == "bf16-mixed"  # the default mixed policy
    assert main(["doctor", "--model", "mlp", "--policy", "O2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "policy O2-bf16: half dtype bfloat16" in out and "keep the policy 'O2-bf16'" in out


def test_help_names_the_options_and_the_columns(capsys):
    assert main(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    for word in ("--policy", "--plot", "--json", "--top", "out SQNR dB", '"inf"', "O2-fp16"):
        assert word in out


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="--plot needs matplotlib (cli extra)")
def test_plot_is_written(capsys, tmp_path, user_models):
    path = tmp_path / "sub" / "doctor.png"
    assert main(["doctor", "--model", f"{user_models}:hot", "--policy", "16-mixed",
                 "--plot", str(path), "--quiet"]) == 0
    assert f"plot: {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_json_to_stdout_leaves_the_tables_on_stderr(capsys):
    assert main(["doctor", "--model", "mlp", "--policy", "16-mixed", "--json", "-"]) == 0
    captured = capsys.readouterr()
    doc = strict(captured.out)  # nothing but the document on stdout
    assert doc["policy"] == "16-mixed" and [m["name"] for m in doc["modules"]] == ["0", "1", "2", "3"]
    assert doc["modules"][0]["out_sqnr_db"] == "inf"  # Flatten: identical to fp32
    assert "first non-finite: none" in captured.err and "advice:" in captured.err


@pytest.mark.slow
def test_the_command_runs_as_a_user_would(tmp_path, models_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "ampkit.cli", "doctor", "--model",
                           f"{MODULE}:hot", "--policy", "16-mixed", "--json", "-"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=models_dir)
    assert proc.returncode == 0, proc.stderr
    assert strict(proc.stdout)["first_nonfinite"] == ["forward", "2"]
    assert "first non-finite: module '2'" in proc.stderr


# --- bad input: one line, exit 2, before any work ------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--model", "nope"], ["unknown model 'nope'", "mlp, cnn"]),
    (["--model", "mlp", "--policy", "O9"], ["unknown policy 'O9'", "bf16-mixed"]),
    (["--model", "mlp", "--policy", "fp8-weekly"], ["unknown fp8 recipe 'weekly'", "tensorwise"]),
    (["--model", "mlp", "--policy", "auto"], ["--policy auto", "one policy"]),
    (["--model", "mlp", "--device", "tpu"], ["unknown device 'tpu'", "valid: cpu"]),
    (["--model", "mlp", "--plot", "out.pdf"], ["--plot 'out.pdf'", ".png"]),
    (["--model", "mlp", "--top", "-1"], ["--top must be 0 (all) or more"]),
    (["--model", "mlp", "--batch-size", "0"], ["--batch-size must be a positive integer"]),
    (["--model", "no_such_module_x:make"], ["cannot import 'no_such_module_x'"]),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, words):
    line = usage_error(capsys, *argv, "--quiet")
    assert line.startswith("ampkit doctor: error:")
    for word in words:
        assert word in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert "not available here" in usage_error(capsys, "--model", "mlp", "--device", "cuda")


def test_unwritable_output_is_refused_before_running(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = usage_error(capsys, "--model", "mlp", "--json", str(blocker / "r.json"))
    assert "--json" in line and "cannot be written" in line


def test_plot_without_matplotlib_is_refused_before_running(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    line = usage_error(capsys, "--model", "mlp", "--plot", "out.png")
    assert "needs matplotlib" in line and "pip install" in line


def test_a_model_that_is_not_fp32_is_refused(capsys, user_models):
    line = usage_error(capsys, "--model", f"{user_models}:halved", "--quiet")
    assert "returned a model whose parameter" in line and "torch.float16" in line


def test_a_batch_size_below_1_is_refused_for_a_user_function_too(capsys, user_models):
    for size in ("0", "-2"):
        line = usage_error(capsys, "--model", f"{user_models}:sized", "--batch-size", size)
        assert f"--batch-size must be a positive integer, got {size}" in line


def test_a_batch_without_samples_reports_no_flop_share(capsys, user_models):
    # The function's own empty batch: its matmuls count 0 FLOPs, so there is no share.
    assert main(["doctor", "--model", f"{user_models}:sized", "--quiet"]) == 0
    assert "no matmul or convolution ran" in capsys.readouterr().out


def test_an_error_the_model_raises_while_running_is_a_failure_not_a_usage_error(
        capsys, user_models):
    assert main(["doctor", "--model", f"{user_models}:broken", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "failed: ValueError: bad shape inside my model" in err[0], err


def test_a_model_returning_a_tuple_without_a_loss_fn_says_what_to_return(capsys, user_models):
    assert main(["doctor", "--model", f"{user_models}:pair", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "failed: TypeError:" in err[0], err
    assert "returned a tuple" in err[0] and "loss_fn(output, target)" in err[0]


def test_an_unknown_policy_lists_only_what_doctor_runs(capsys):
    line = usage_error(capsys, "--model", "mlp", "--policy", "bogus", "--quiet")
    assert "unknown policy 'bogus'" in line and "fp8-rowwise" in line and "bf16-mixed" in line
    assert "auto" not in line


def test_fp8_dash_without_a_recipe_is_refused(capsys):
    line = usage_error(capsys, "--model", "mlp", "--policy", "fp8-", "--quiet")
    assert "'fp8-'" in line and "fp8-tensorwise" in line


def test_doctor_keeps_the_modes_the_function_built_the_model_with(capsys, user_models):
    """The doctor put the whole model in training mode: a backbone returned in eval mode
    on purpose was diagnosed in training mode (inspect keeps the modes it is given)."""
    import importlib

    assert main(["doctor", "--model", f"{user_models}:eval_backbone", "--quiet"]) == 0
    seen = importlib.import_module(user_models).SEEN_TRAINING
    assert seen and not any(seen)


_BATCH_MODELS = """\
import torch


class Keywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 2), torch.nn.Linear(3, 2)

    def forward(self, x, z):
        return self.a(x) + self.b(z)


def as_dict():
    torch.manual_seed(0)
    return Keywords(), ({"x": torch.randn(5, 4), "z": torch.randn(5, 3)}, torch.randn(5, 2))


def as_tuple():
    torch.manual_seed(0)
    return Keywords(), ((torch.randn(5, 4), torch.randn(5, 3)), torch.randn(5, 2))


def no_target():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2), (torch.randn(5, 4), None)


class Listed(Keywords):
    def forward(self, xs):
        return super().forward(*xs)


def as_list():
    torch.manual_seed(0)
    return Listed(), ([torch.randn(5, 4), torch.randn(5, 3)], torch.randn(5, 2))


def no_tensor():
    return torch.nn.Linear(4, 2), ({"x": 1}, torch.randn(5, 2))
"""


def test_a_user_functions_batch_may_be_a_dict_a_tuple_or_have_no_target(capsys, tmp_path,
                                                                         monkeypatch):
    """doctor, bench and tune took only two tensors from a user function: a model of
    keyword inputs (an HF model's dict batch) or one without a target was refused."""
    (tmp_path / "batchmods.py").write_text(_BATCH_MODELS)
    monkeypatch.chdir(tmp_path)  # bench's policy workers import it from the current folder
    monkeypatch.syspath_prepend(str(tmp_path))
    docs = {}
    for name in ("as_dict", "as_tuple", "no_target", "as_list"):
        out = tmp_path / f"{name}.json"
        assert main(["doctor", "--model", f"batchmods:{name}", "--policy", "bf16-mixed",
                     "--json", str(out), "--quiet"]) == 0, capsys.readouterr().err
        docs[name] = strict(out.read_text())
    # The same weights and batch, given as keywords or positionally: the same report.
    assert docs["as_dict"]["modules"] == docs["as_tuple"]["modules"] == docs["as_list"]["modules"]
    assert [m["name"] for m in docs["as_dict"]["modules"]] == ["a", "b"]
    assert [m["name"] for m in docs["no_target"]["modules"]] == [""]
    bench_json = tmp_path / "bench.json"
    assert main(["bench", "--model", "batchmods:as_dict", "--policies",
                        "32-true,bf16-mixed", "--steps", "2", "--warmup", "1", "--json",
                        str(bench_json), "--quiet"]) == 0, capsys.readouterr().err
    bench = strict(bench_json.read_text())
    assert [r["policy"] for r in bench["results"]] == ["32-true", "bf16-mixed"]
    assert all(r["samples_per_s"] > 0 for r in bench["results"])
    capsys.readouterr()
    line = usage_error(capsys, "--model", "batchmods:no_tensor", "--quiet")
    assert "returned (Linear, ({'x': int}, Tensor(5, 2)))" in line
    assert "a dict of them (model(**inputs))" in line and "None" in line
    for name in ("as_dict", "as_list"):  # tune takes them too
        tuned = tmp_path / f"tune_{name}.json"
        assert main(["tune", "--model", f"batchmods:{name}", "--steps", "3", "--candidates",
                     "32-true", "--json", str(tuned), "--quiet"]) == 0, capsys.readouterr().err
        assert strict(tuned.read_text())["recommended"] == "32-true"
