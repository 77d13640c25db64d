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
