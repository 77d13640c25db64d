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
