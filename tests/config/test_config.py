"""Config loading: every bad input is a one-line ConfigError naming the key or file, and nothing else.

Fuzzes config_from_dict with dicts shaped like the real schema (plus junk), load_config with
random file contents, and parse_override with random `--set` strings; checks that what loads
writes back to TOML and loads again to an equal config.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config.schema import RunConfig
from pipeline.config.io import config_from_dict, dump_toml, load_config, parse_override
from pipeline.errors import ConfigError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _schema(cls: type = RunConfig, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the config as a dotted path -> its type."""
    out: dict[str, Any] = {}
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(tp):
            out.update(_schema(tp, key))
        else:
            out[key] = tp
    return out


LEAVES = _schema()
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in LEAVES if "." in k})


def _nested(path: str, value: Any) -> dict[str, Any]:
    data: Any = value
    for part in reversed(path.split(".")):
        data = {part: data}
    return data


def _paths(data: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(data, dict):
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            out |= {key} | _paths(v, key)
    return out


def _assert_names_a_key(msg: str, data: Any) -> None:
    """The message is one line and names a real key of the schema or a key the input gave."""
    assert "\n" not in msg and len(msg) < 600, msg
    candidates = set(LEAVES) | set(SECTIONS) | _paths(data)
    assert any(re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", msg) for k in candidates), msg


def _assert_round_trips(cfg: RunConfig) -> None:
    assert config_from_dict(tomllib.loads(dump_toml(cfg))) == cfg


# --------------------------------------------------------------------------- strategies

junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70), st.just(10**400),
              st.floats(), st.text(max_size=8)),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=2),
    max_leaves=6,
)


def _good(tp: Any) -> st.SearchStrategy[Any]:
    """Values of the right type (often in range, not always)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin is tuple:
        return st.lists(_good(typing.get_args(tp)[0]), min_size=0, max_size=3)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(st.integers(0, 64), st.sampled_from([8, 16, 2048, -1, 2**63 - 1, 2**63]))
    if tp is float:
        return st.one_of(st.floats(0, 1), st.floats(1, 100), st.sampled_from([0.0, 1.0, -1.0, math.inf, math.nan]))
    if tp is str:
        return st.one_of(st.sampled_from(["", "cpu", "cuda:0", "cuda:x", "all-linear", "/nonexistent/model"]),
                         st.text(max_size=6))
    raise AssertionError(f"no strategy for {tp}")


def _section(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    fields = {}
    for name, tp in typing.get_type_hints(cls).items():
        fields[name] = _section(tp) if dataclasses.is_dataclass(tp) else st.one_of(_good(tp), _good(tp), junk)
    known = st.fixed_dictionaries({}, optional=fields)
    extra = st.dictionaries(st.sampled_from(["junk", "step", "kinds", ""]), junk, max_size=1)
    return st.tuples(known, extra, st.integers(0, 9)).map(lambda t: {**t[0], **t[1]} if t[2] == 0 else t[0])


config_dicts = st.one_of(_section(RunConfig), junk)


# --------------------------------------------------------------------------- fuzz


@FUZZ
@given(data=config_dicts)
def test_config_from_dict_returns_a_config_or_names_the_key(data: Any) -> None:
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:
        if isinstance(data, dict):
            _assert_names_a_key(str(e), data)
        else:
            assert "table of sections" in str(e)
        return
    assert isinstance(cfg, RunConfig)
    _assert_round_trips(cfg)


toml_lines = st.one_of(
    st.sampled_from(["[engine]", "[engine.vllm]", "[pipeline]", "[[engine]]", "[seed]", "[trainer]", "[junk]",
                     "[sampling]", "[loss]", "[model]", ""]),
    st.tuples(
        st.sampled_from(["seed", "out", "steps", "kind", "lr", "betas", "devices", "engine", "path", "n",
                         "max_staleness", "temperature", "junk", '"quoted key"', "a.b"]),
        st.sampled_from(["1", "-1", "0", "1e400", "nan", "inf", "-inf", "0.5", '"x"', '""', '"cuda:0"', "'cpu'",
                         "[1, [2]]", "[0.9, 0.99]", '["cpu", "cuda:1"]', "{a = 1}", "true", "1979-05-27",
                         "99999999999999999999", "1" + "0" * 400, "'''", "[" * 3000, '"a\\rb"',
                         '"\\u0000"', "[]", "{}"]),
    ).map(lambda kv: f"{kv[0]} = {kv[1]}"),
)
config_files = st.one_of(
    st.lists(toml_lines, max_size=8).map(lambda lines: "\n".join(lines).encode()),
    st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.binary(max_size=40),
)


@FUZZ
@given(content=config_files)
def test_load_config_on_any_file_content_returns_a_config_or_a_config_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_bytes(content)
        try:
            cfg = load_config(path)
        except ConfigError as e:
            assert "\n" not in str(e), str(e)
            return
    assert isinstance(cfg, RunConfig)
    _assert_round_trips(cfg)


overrides = st.one_of(
    st.text(max_size=20),
    st.tuples(st.sampled_from([*LEAVES, *SECTIONS, "seed.x", "pipeline.junk", "", " ", "a..b", "1x"]),
              st.one_of(st.sampled_from(["1", "-1", "1e400", "nan", "x y", "[1,", "{steps=3}", "{kind='vllm'}",
                                         '"a\\u0000"', "true", "1" + "0" * 400, "[" * 3000, "[", "[[]]", ""]),
                        st.text(max_size=8)))
    .map(lambda kv: f"{kv[0]}={kv[1]}"),
)


@FUZZ
@given(texts=st.lists(overrides, min_size=1, max_size=3))
def test_any_set_override_returns_a_config_or_a_config_error(texts: list[str]) -> None:
    try:
        cfg = load_config(None, texts)
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
        return
    assert isinstance(cfg, RunConfig)
    _assert_round_trips(cfg)


@FUZZ
@given(out=st.text(), root=st.text(), modules=st.lists(st.text(min_size=1), min_size=1, max_size=3),
       lr=st.floats(0, 1e300), timeout=st.floats(1e-300, 1e300), steps=st.integers(1, 2**63 - 1),
       devices=st.lists(st.sampled_from(["cpu", "cuda:0", "cuda:12"]), min_size=1, max_size=3))
def test_every_valid_config_writes_back_to_an_equal_one(out: str, root: str, modules: list[str], lr: float,
                                                        timeout: float, steps: int, devices: list[str]) -> None:
    data = {"out": out, "store": {"root": root},
            "trainer": {"target_modules": modules, "lr": lr, "betas": [0, 0.5]},
            "engine": {"request_timeout_s": timeout, "devices": devices}, "pipeline": {"steps": steps}}
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:  # only a NUL character or a lone surrogate in a path is refused here
        assert re.match(r"(out|store\.root) must be (a path without NUL|UTF-8)", str(e)), str(e)
        return
    _assert_round_trips(cfg)


# --------------------------------------------------------------------------- every field, one bad value


@pytest.mark.parametrize("key", sorted(LEAVES))
def test_a_table_where_a_value_belongs_names_that_key(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict(_nested(key, {"x": 1}))
    assert str(e.value).startswith(f"{key} must be "), str(e.value)


OUT_OF_RANGE = {int: [2**63, -(2**63) - 1, 10**400], float: [10**400, math.nan, math.inf, -math.inf]}


@pytest.mark.parametrize("key, value", [(k, v) for k, tp in sorted(LEAVES.items()) for v in OUT_OF_RANGE.get(tp, [])],
                         ids=lambda x: str(x)[:12])
def test_numbers_beyond_range_name_the_key(key: str, value: Any) -> None:
    allowed = "a 64-bit integer" if LEAVES[key] is int else "a finite number"
    with pytest.raises(ConfigError) as e:
        config_from_dict(_nested(key, value))
    assert str(e.value).startswith(f"{key} must be {allowed}"), str(e.value)


@pytest.mark.parametrize("section", SECTIONS)
def test_a_value_where_a_section_belongs_names_the_section(section: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(section)} must be a table, got 3$"):
        config_from_dict(_nested(section, 3))


# --------------------------------------------------------------------------- explicit cases


def _load_text(tmp_path: Path, text: str | bytes, overrides: list[str] | None = None) -> RunConfig:
    path = tmp_path / "c.toml"
    if isinstance(text, str):
        path.write_text(text, encoding="utf-8")
    else:
        path.write_bytes(text)
    return load_config(path, overrides)


@pytest.mark.parametrize("text, expected", [
    ("[pipeline]\nmax_staleness = -1\n", "pipeline.max_staleness must be >= 0, got -1"),
    ("[pipeline]\nstepz = 3\n", "unknown key 'pipeline.stepz'; allowed here: steps, "),
    ("engine = 3\n", "engine must be a table, got 3"),
    ("[seed]\nx = 1\n", "seed must be an integer, got {'x': 1}"),
    ("[trainer]\nlr = 1" + "0" * 400 + "\n", "trainer.lr must be a finite number"),
    ("[trainer]\nlr = 1e400\n", "trainer.lr must be a finite number, got inf"),
    ("[trainer]\nlr = nan\n", "trainer.lr must be a finite number, got nan"),
    ("[pipeline]\nsteps = 99999999999999999999\n", "pipeline.steps must be a 64-bit integer"),
    ('[engine]\nkind = ""\n', "engine.kind must be one of 'transformers', 'vllm', 'vllm_server', 'simulated', got ''"),
    ("[engine]\ndevices = [0]\n", "engine.devices[0] must be a string, got 0"),
    ('[engine]\ndevices = ["cuda:²"]\n', 'engine.devices[0] must be "cpu" or "cuda:N"'),
    ('[engine]\ndevices = [["cpu"]]\n', "engine.devices[0] must be a string"),
    ('[trainer]\nbetas = "0.9, 0.99"\n', "trainer.betas must be a list of finite numbers"),
    ('[trainer]\ntarget_modules = [""]\n', "trainer.target_modules must be a non-empty list of module names"),
    ("seed = -1\n", "seed must be in [0, "),
    ('out = "a\\u0000b"\n', "out must be a path without NUL characters"),
    ("[engine]\nrestarts = -1\n", "engine.restarts must be >= 0 (0 = never restart), got -1"),
    ("[engine]\nrestart_backoff_s = -0.5\n", "engine.restart_backoff_s must be >= 0, got -0.5"),
    ("[engine.simulated]\ndie_after = -3\n", "engine.simulated.die_after must be >= 0 (0 = never), got -3"),
    ("[engine.simulated]\nfailed_restarts = -1\n", "engine.simulated.failed_restarts must be >= 0, got -1"),
])
def test_bad_value_in_a_file_names_the_key_and_what_is_allowed(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        _load_text(tmp_path, text)
    assert str(e.value).startswith(expected), str(e.value)


@pytest.mark.parametrize("key", ["model.path", "model.cache_dir", "data.train", "data.eval", "data.chat_template",
                                 "store.root", "out"])
def test_a_path_is_checked_as_text_here_and_looked_up_by_the_preflight(tmp_path: Path, key: str) -> None:
    # whether it exists is tests/loop/test_preflight.py's: a config naming a missing path loads
    missing = str(tmp_path / "no-such-path")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be a path without NUL characters, got 'a\\x00b'$"):
        load_config(None, {key: "a\x00b", "reward.functions": ["m:f"]})
    cfg = load_config(None, {key: missing, "reward.functions": ["m:f"]})
    section, _, name = key.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, name) == missing


def test_every_key_has_its_meaning_in_the_reference() -> None:
    """The reference reads each meaning from the comment beside its field: a field written so the
    reading misses it shows here, not as a blank cell in docs/configuration.md."""
    from pipeline.config.io import reference_markdown

    rows = [line for line in reference_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) == len(LEAVES)
    assert [row for row in rows if row.rstrip().endswith("|  |")] == []


@pytest.mark.parametrize("text, expected", [
    ("[pipeline]\nsteps = 1\nsteps = 2\n", r"is not valid TOML: .*line 3"),
    ("seed = \n", r"is not valid TOML"),
    ("seed = " + "[" * 5000 + "]" * 5000 + "\n", r"(nests arrays or tables too deeply|is not valid TOML)"),
    (b"seed = 1\n\xff\xfe\n", r"is not UTF-8 text"),
])
def test_a_broken_file_names_the_file(tmp_path: Path, text: str | bytes, expected: str) -> None:
    with pytest.raises(ConfigError, match=rf"^config file '.*c\.toml' {expected}"):
        _load_text(tmp_path, text)


def test_a_file_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    assert _load_text(tmp_path, "\ufeffseed = 3\n").seed == 3


def test_a_config_path_that_is_missing_a_directory_or_unreadable_names_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"config file '.*nope\.toml' does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"config file '.*' is a directory"):
        load_config(tmp_path)
    path = tmp_path / "c.toml"
    path.write_text("seed = 1\n")

    def refuse(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)  # chmod does not stop root, who may run the tests
    with pytest.raises(ConfigError, match=r"config file '.*c\.toml' cannot be read: Permission denied"):
        load_config(path)


@pytest.mark.parametrize("text, expected", [
    ("pipeline.max_staleness=-1", r"^pipeline\.max_staleness must be >= 0, got -1$"),
    ("=3", r"^override '=3': '' is not a dotted key"),
    ("seed", r"^override 'seed' must look like section\.key=value$"),
    ("seed.x=1", r"^override seed\.x: seed is a value \(an integer\), not a section$"),
    ("pipeline.stepz=1", r"^override pipeline\.stepz: unknown key 'pipeline\.stepz'; allowed here: steps"),
    ("junk.x=1", r"^override junk\.x: unknown key 'junk'; allowed here: seed, deterministic, out, model"),
    ("seed=1\nout=2", r"^override seed: the value must be on one line"),
    ("seed=" + "[" * 5000, r"^override seed: the value nests too deeply"),
    ("engine.kind=", r"^engine\.kind must be one of"),
])
def test_a_bad_override_names_the_key(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [text])


def test_overrides_parse_toml_values_and_bare_words() -> None:
    assert parse_override("trainer.lr = 0") == (["trainer", "lr"], 0)
    assert parse_override("engine.kind=simulated") == (["engine", "kind"], "simulated")
    assert parse_override('engine.devices=["cpu", "cpu"]') == (["engine", "devices"], ["cpu", "cpu"])


def test_an_override_table_updates_the_files_table_instead_of_replacing_it(tmp_path: Path) -> None:
    cfg = _load_text(tmp_path, '[engine]\nkind = "simulated"\n[engine.vllm]\nmax_loras = 3\n',
                     ["engine={vllm={seed=7}}"])
    assert (cfg.engine.kind, cfg.engine.vllm.max_loras, cfg.engine.vllm.seed) == ("simulated", 3, 7)


def test_an_override_into_a_section_the_file_gave_as_a_value_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^engine must be a table, got 3$"):
        _load_text(tmp_path, "engine = 3\n", ["engine.kind=vllm"])


def test_strings_with_control_characters_and_quotes_write_back_exactly() -> None:
    cfg = config_from_dict({"out": 'a\rb\x01"\\\t\n\x7fé', "store": {"root": "'''"}})
    _assert_round_trips(cfg)


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_config_loads_and_says_what_it_sets(path: Path) -> None:
    """The shipped examples are valid configs, and each sets what its name promises."""
    from pipeline.config.io import load_config

    cfg = load_config(path)
    if "gpu" in path.name:
        assert cfg.engine.kind == "vllm" and all(d.startswith("cuda:") for d in cfg.engine.devices)
    if "full_weights" in path.name:
        assert cfg.trainer.update == "full"
    if "one_gpu_full_weights" in path.name:  # one GPU: the versions go through its memory
        assert cfg.trainer.publish == "memory" and cfg.engine.devices == (cfg.trainer.device,)
    if "trainer_ranks" in path.name:
        assert len(cfg.trainer.devices) > 1 and not set(cfg.trainer.devices) & set(cfg.engine.devices)
    if "launched" in path.name:
        assert cfg.engine.kind == "vllm_server" and cfg.engine.vllm_server.launch
    assert tomllib.loads(path.read_text())  # plain TOML, readable without the project
