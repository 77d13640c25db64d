"""bench/speculative.py's own argument handling: servers compared side by side, each with its own settings."""
import pytest

from bench.speculative import make_parser, parse_env


def test_server_settings_parse_into_an_environment():
    assert parse_env("") == {}
    assert parse_env("OMP_NUM_THREADS=1  GOMP_SPINCOUNT=10000") == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "10000"}
    assert parse_env("A=x=y B=") == {"A": "x=y", "B": ""}  # the first "=" splits; an empty value is a value
    for bad in ("OMP_NUM_THREADS", "=1"):
        with pytest.raises(SystemExit, match="KEY=VALUE"):
            parse_env(bad)


def test_one_server_as_is_unless_asked():
    assert make_parser().parse_args([]).server_envs == [""]
    args = make_parser().parse_args(["--server-envs", "", "OMP_NUM_THREADS=1"])
    assert args.server_envs == ["", "OMP_NUM_THREADS=1"]


def test_packs_compared_side_by_side_are_named_by_directory(tmp_path):
    from bench.speculative import pack_labels

    assert make_parser().parse_args([]).model_dir[-1].endswith("model")  # one pack, the shipped one, unless asked
    assert pack_labels(["model"]) == [""]  # a single pack keeps the rows' old names
    a, b = tmp_path / "runs" / "four" / "model", tmp_path / "six"
    assert pack_labels([str(a), str(b)]) == ["four", "six"]  # a run's model/ is named by its run
    c = tmp_path / "other" / "six"
    assert pack_labels([str(b), str(c)]) == [str(b), str(c)]  # clashing names: the paths
    with pytest.raises(SystemExit, match="same pack twice"):
        pack_labels([str(b), str(tmp_path / "x" / ".." / "six")])


def test_llama_cpp_rows_rebuild_greedy_output_and_project_speedups():
    """The llama.cpp rows' own arithmetic: the tokens a greedy verifier emits, rebuilt from each pass's greedy tokens
    and the draft it checked; and Leviathan's projection from a row's measured split."""
    from bench.llama_cpp_rows import greedy_by_pass, projected

    passes = [([5], [1.0], []),  # the prefill: one row, no draft -> emits 5
              ([7, 8, 9], [0.5, 0.2, 3.0], [7, 4]),  # draft 7 4: 7 accepted, 8 the bonus
              ([1, 2, 3], [0.1, 0.1, 0.1], [1, 2])]  # both accepted, 3 the bonus
    assert greedy_by_pass(passes) == ([5, 7, 8, 1, 2, 3], [1.0, 0.5, 0.2, 0.1, 0.1, 0.1])
    row = {"mal": 2.0, "steps": 10, "verify_s": 1.0, "draft_s": 0.4, "overhead_s": 0.6}
    p = projected(row, {"seconds": 1.0, "tokens": 10})  # a plain step: 0.1 s
    assert p["v"] == pytest.approx(1.0) and p["ck"] == pytest.approx(1.0)
    assert p["1x"] == pytest.approx(1.0) and p["10x"] == pytest.approx(2 / 1.1)
    assert p["50x v=1"] == pytest.approx(2 / 1.02)
    slow_verify = projected({**row, "verify_s": 2.0}, {"seconds": 1.0, "tokens": 10})
    assert slow_verify["10x"] == pytest.approx(2 / 2.1) and slow_verify["10x v=1"] == pytest.approx(2 / 1.1)
