"""``modelsize check``: the CI gate, on the demo's real files and on clean ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelsize.checking import DEFAULT_FORBID, check, parse_forbid
from modelsize.cli import main
from modelsize.findings import FindingKind

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from modelsize.cli.demo import inspect_section

    out = tmp_path_factory.mktemp("demo")
    inspect_section(out)
    return out


@pytest.fixture()
def clean(tmp_path: Path) -> Path:
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(256, 256), "b": torch.zeros(256)}, path)
    return path


def test_a_training_checkpoint_fails_on_its_optimizer_state(demo: Path, capsys: Any) -> None:
    path = demo / "train.pt"
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    hits = [line for line in out if line.startswith(f"{path}: optimizer_state: ")]
    assert len(hits) == 1
    assert f"modelsize slim {path}" in hits[0]
    # the bytes named are the optimizer state's: exp_avg + exp_avg_sq of every parameter
    sd = torch.load(path, weights_only=True)
    state = sum(t.numel() * t.element_size() for s in sd["optimizer"]["state"].values()
                for k, t in s.items() if k in ("exp_avg", "exp_avg_sq"))
    result = check(path)
    (v,) = [v for v in result.violations if v.rule == "optimizer_state"]
    assert v.bytes >= state


def test_each_demo_story_breaks_its_rule(demo: Path) -> None:
    expect = {"train.pt": "optimizer_state", "first_rows.pt": "unused_storage",
              "whole_model.pt": "activations", "tied.safetensors": "duplicates",
              "tf1_mlp_adam": "optimizer_state"}
    for name, rule in expect.items():
        result = check(demo / name)
        assert rule in {v.rule for v in result.violations}, name
    # float64 is a matter of taste: allowed unless forbidden by name
    assert check(demo / "model_f64.pt").ok
    assert not check(demo / "model_f64.pt", forbid=["wide_dtype"]).ok


def test_a_clean_file_passes_and_says_so_on_stderr(clean: Path, capsys: Any) -> None:
    assert main(["check", str(clean)]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "1 file, all pass" in captured.err


def test_max_size(clean: Path, capsys: Any) -> None:
    size = clean.stat().st_size
    assert main(["check", str(clean), "--max-size", str(size)]) == 0
    capsys.readouterr()
    assert main(["check", str(clean), "--max-size", str(size - 1)]) == 1
    (line, _summary) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{clean}: max_size: ")
    assert check(clean, max_size=size - 100).violations[0].bytes == 100


def test_forbid_none_and_json(demo: Path, clean: Path, capsys: Any) -> None:
    assert main(["check", str(demo / "train.pt"), "--forbid", "none"]) == 0
    capsys.readouterr()
    assert main(["check", str(demo / "train.pt"), str(clean), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False
    assert [f["ok"] for f in data["files"]] == [False, True]
    assert data["files"][0]["violations"][0]["rule"] == "optimizer_state"


def test_parse_forbid() -> None:
    assert parse_forbid("optimizer_state, Duplicates,duplicates") == (
        FindingKind.OPTIMIZER_STATE, FindingKind.DUPLICATES)
    assert parse_forbid("none") == ()
    assert set(DEFAULT_FORBID) == set(parse_forbid(
        "unsafe_code,optimizer_state,gradients,activations,unused_storage,duplicates"))


@pytest.mark.parametrize("args", [["--forbid", "optimiser"], ["--max-size", "huge"]])
def test_bad_arguments_are_one_line_exit_2(clean: Path, args: list[str], capsys: Any) -> None:
    assert main(["check", str(clean), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("modelsize: ")


def test_unreadable_file_is_exit_2(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"not a model")
    assert main(["check", str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_pre_commit_hook_runs_check() -> None:
    hooks = (Path(__file__).parent.parent / ".pre-commit-hooks.yaml").read_text()
    assert "id: modelsize-check" in hooks
    assert "entry: modelsize check" in hooks


def test_the_library_takes_sizes_as_the_cli_does(clean: Path) -> None:
    """``check(path, max_size="10MB")`` raised a raw TypeError (issue 18 #20)."""
    import modelsize

    size = clean.stat().st_size  # 263 KiB: over 200kB and 200KiB, under 1MB
    assert modelsize.check(clean, max_size="1MB").ok
    assert modelsize.check(clean, max_size="1 MiB").ok
    assert modelsize.check(clean, max_size=size).ok
    (v,) = modelsize.check(clean, max_size="200kB").violations
    assert v.bytes == size - 200_000
    (v,) = modelsize.check(clean, max_size="200KiB").violations
    assert v.bytes == size - 200 * 1024
    assert modelsize.check(clean, forbid="wide_dtype,duplicates").ok


@pytest.mark.parametrize("bad", ["huge", "-5MB", "1e999", "nan", -1, 1.5, True, [1]])
def test_bad_max_size_in_the_library_is_one_usage_error(clean: Path, bad: Any) -> None:
    from modelsize.errors import UsageError

    with pytest.raises(UsageError, match=r"^max_size: ") as exc:
        check(clean, max_size=bad)
    assert "\n" not in str(exc.value)
