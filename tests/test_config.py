"""Tests for chandrad.config: parsing, defaults, typed problems with lines, the shipped file."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from chandrad import config
from chandrad.errors import ConfigError, ConfigProblem, ExitCode

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "etc" / "chandrad.toml"
WATCH = '[[watch]]\ninput = "/srv/in"\n'


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "chandrad.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _problems(tmp_path: Path, text: str) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as info:
        config.load_config(_write(tmp_path, text))
    assert info.value.exit_code == ExitCode.CONFIG
    return info.value.problems


def _one(tmp_path: Path, text: str) -> ConfigProblem:
    problems = _problems(tmp_path, text)
    assert len(problems) == 1, problems
    return problems[0]


# ----------------------------------------------------------------------------- defaults


def test_minimal_config_gets_every_default(tmp_path: Path) -> None:
    """A config with one watch input gets the dataclass defaults everywhere else."""
    cfg = config.load_config(_write(tmp_path, WATCH))
    assert cfg.daemon == config.DaemonConfig()
    assert cfg.ocr == config.OcrConfig()
    assert cfg.engine == config.EngineConfig()
    assert cfg.control == config.ControlConfig()
    assert cfg.engine.supervised and cfg.engine.base_url == "http://127.0.0.1:8000"
    (watch,) = cfg.watch
    assert watch.input == Path("/srv/in")
    assert (watch.output, watch.done, watch.failed) == (
        Path("/srv/output"), Path("/srv/done"), Path("/srv/failed"))
    assert (watch.recursive, watch.mode, watch.duplicates) == (True, "auto", "process")


def test_documented_chandra_defaults() -> None:
    """The documented defaults: Chandra's render limits, formats, auto batching."""
    ocr = config.OcrConfig()
    assert (ocr.min_side_px, ocr.max_pixels, ocr.prompt_type) == ("auto", 6291456, "ocr_layout")
    assert ocr.formats == ("md", "html", "json")
    memory = config.MemoryConfig()
    assert memory.max_num_seqs == "auto" and memory.max_num_batched_tokens == "auto"
    assert memory.limit_mm_per_prompt == {"image": 1}


def test_relative_paths_resolve_beside_the_config_file(tmp_path: Path) -> None:
    """Relative paths in the file are taken relative to the file's folder, not the cwd."""
    text = ('[daemon]\nstate_dir = "state"\n[[watch]]\ninput = "in"\noutput = "out"\n'
            '[control]\nsocket = "run/c.sock"\n')
    cfg = config.load_config(_write(tmp_path, text))
    base = tmp_path.resolve()
    assert cfg.daemon.state_dir == base / "state"
    assert cfg.watch[0].input == base / "in"
    assert cfg.watch[0].output == base / "out"
    assert cfg.watch[0].done == base / "done"
    assert cfg.control.socket == base / "run" / "c.sock"


def test_several_watch_tables(tmp_path: Path) -> None:
    """Each [[watch]] table becomes its own WatchConfig, in file order."""
    text = (WATCH + 'mode = "poll"\npoll_interval = 1\nignore = ["*.part"]\n'
            '[[watch]]\ninput = "/data/b/in"\nrecursive = false\nduplicates = "skip"\n')
    cfg = config.load_config(_write(tmp_path, text))
    assert [w.input for w in cfg.watch] == [Path("/srv/in"), Path("/data/b/in")]
    assert cfg.watch[0].mode == "poll" and cfg.watch[0].poll_interval == 1.0
    assert isinstance(cfg.watch[0].poll_interval, float)
    assert cfg.watch[0].ignore == ("*.part",)
    assert cfg.watch[1].recursive is False and cfg.watch[1].duplicates == "skip"


def test_memory_values_and_auto(tmp_path: Path) -> None:
    """[engine.memory] numbers, "auto", dict knobs and block size in tokens are accepted."""
    text = WATCH + ('[engine.memory]\ngpu_memory_utilization = "auto"\nmax_num_seqs = 32\n'
                    'max_num_batched_tokens = "auto"\nmax_model_len = 16384\nblock_size = 16\n'
                    'enforce_eager = true\ncpu_offload_gb = 4\nkv_cache_memory_bytes = 1000000\n'
                    'limit_mm_per_prompt = { image = 2 }\n'
                    'mm_processor_kwargs = { min_pixels = 3136, max_pixels = 6291456 }\n'
                    'mm_processor_cache_gb = 2.5\n')
    memory = config.load_config(_write(tmp_path, text)).engine.memory
    assert memory == config.MemoryConfig(
        gpu_memory_utilization="auto", max_num_seqs=32, max_num_batched_tokens="auto",
        max_model_len=16384, block_size=16, enforce_eager=True, cpu_offload_gb=4.0,
        kv_cache_memory_bytes=1000000, limit_mm_per_prompt={"image": 2},
        mm_processor_kwargs={"min_pixels": 3136, "max_pixels": 6291456},
        mm_processor_cache_gb=2.5)


def test_engine_command_env_and_gpus(tmp_path: Path) -> None:
    """command may be a list or a string; gpus may be an int; env is string to string."""
    text = WATCH + ('[engine]\ncommand = "/opt/vllm/bin/python -m vllm.entrypoints.openai.'
                    'api_server"\ngpus = 1\nextra_args = ["--seed", "1"]\n'
                    'env = { VLLM_CPU_KVCACHE_SPACE = "1" }\n')
    engine = config.load_config(_write(tmp_path, text)).engine
    assert engine.command == ("/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server")
    assert engine.gpus == "1"
    assert engine.extra_args == ("--seed", "1")
    assert engine.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_downshift_backoff_pair(tmp_path: Path) -> None:
    """backoff = [initial, max] fills backoff_initial and backoff_max."""
    text = WATCH + "[engine.downshift]\nbackoff = [2, 30]\nmax_restarts = 3\n"
    downshift = config.load_config(_write(tmp_path, text)).engine.downshift
    assert (downshift.backoff_initial, downshift.backoff_max) == (2.0, 30.0)
    assert downshift.max_restarts == 3


def test_control_mode_octal_string_or_int(tmp_path: Path) -> None:
    """control.mode accepts "0640" (octal text) and a TOML octal integer."""
    cfg = config.load_config(_write(tmp_path, WATCH + '[control]\nmode = "0640"\n'))
    assert cfg.control.mode == 0o640
    cfg = config.load_config(_write(tmp_path, WATCH + "[control]\nmode = 0o600\n"))
    assert cfg.control.mode == 0o600


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_keys_named_with_file_and_line(tmp_path: Path) -> None:
    """Unknown keys at every level are reported with their dotted key and line."""
    text = ("bogus = 1\n"                       # 1
            "[daemon]\n"                         # 2
            "log_levle = \"info\"\n"             # 3
            "[[watch]]\n"                        # 4
            "input = \"/srv/in\"\n"              # 5
            "[[watch]]\n"                        # 6
            "input = \"/srv/b\"\n"               # 7
            "setle_seconds = 3\n"                # 8
            "[engine.memroy]\n"                  # 9
            "max_num_seqs = 4\n"                 # 10
            "[engine.memory]\n"                  # 11
            "max_num_seq = 4\n")                 # 12
    problems = _problems(tmp_path, text)
    found = {(p.key, p.line, p.code) for p in problems}
    assert found == {
        ("bogus", 1, "config_key_unknown"),
        ("daemon.log_levle", 3, "config_key_unknown"),
        ("watch[1].setle_seconds", 8, "config_key_unknown"),
        ("engine.memroy", 9, "config_key_unknown"),
        ("engine.memory.max_num_seq", 12, "config_key_unknown"),
    }
    path = str(tmp_path / "chandrad.toml")
    assert all(p.file == path for p in problems)
    assert str(problems[0]).startswith(f"{path}:")


def test_unknown_section(tmp_path: Path) -> None:
    """A misspelt section is an unknown key pointing at its header line."""
    problem = _one(tmp_path, WATCH + "[engin]\nport = 1\n")
    assert (problem.key, problem.line) == ("engin", 3)


# ----------------------------------------------------------------------------- types and ranges


@pytest.mark.parametrize(
    ("section", "line", "key", "code"),
    [
        ("[engine]", 'port = "8000"', "engine.port", "config_type"),
        ("[engine]", "port = 70000", "engine.port", "config_range"),
        ("[engine]", "port = 80.5", "engine.port", "config_type"),
        ("[ocr]", "retries = true", "ocr.retries", "config_type"),
        ("[ocr]", "max_pixels = 10", "ocr.max_pixels", "config_range"),
        ("[ocr]", 'formats = ["md", "docx"]', "ocr.formats", "config_range"),
        ("[ocr]", "formats = [1]", "ocr.formats", "config_type"),
        ("[ocr]", 'prompt_type = "ocr_fancy"', "ocr.prompt_type", "config_range"),
        ("[daemon]", 'log_format = "xml"', "daemon.log_format", "config_range"),
        ("[daemon]", "state_dir = 5", "daemon.state_dir", "config_type"),
        ("[engine.memory]", "gpu_memory_utilization = 1.5",
         "engine.memory.gpu_memory_utilization", "config_range"),
        ("[engine.memory]", 'max_num_seqs = "lots"', "engine.memory.max_num_seqs",
         "config_type"),
        ("[engine.memory]", "max_num_batched_tokens = true",
         "engine.memory.max_num_batched_tokens", "config_type"),
        ("[engine.memory]", "cpu_offload_gb = -1", "engine.memory.cpu_offload_gb",
         "config_range"),
        ("[engine.memory]", 'limit_mm_per_prompt = "image=1"',
         "engine.memory.limit_mm_per_prompt", "config_type"),
        ("[engine]", "env = { A = 1 }", "engine.env", "config_type"),
        ("[engine]", "extra_args = \"--seed 1\"", "engine.extra_args", "config_type"),
        ("[engine.downshift]", "backoff = [60, 1]", "engine.downshift.backoff", "config_range"),
        ("[engine.downshift]", "backoff = [1]", "engine.downshift.backoff", "config_range"),
        ("[control]", 'mode = "rw-rw----"', "control.mode", "config_type"),
        ("[control]", "mode = 0o1777", "control.mode", "config_range"),
    ],
)
def test_wrong_type_or_range_names_key_and_line(
    tmp_path: Path, section: str, line: str, key: str, code: str
) -> None:
    """A bad value is one problem naming the dotted key, its line and the kind of error."""
    problem = _one(tmp_path, f"{WATCH}{section}\n{line}\n")
    assert (problem.key, problem.line, problem.code) == (key, 4, code)


def test_watch_value_problems_use_watch_index(tmp_path: Path) -> None:
    """Problems in the second [[watch]] name watch[1] and the right line."""
    text = WATCH + '[[watch]]\ninput = "/b/in"\nmode = "fanotify"\npoll_interval = 0\n'
    problems = _problems(tmp_path, text)
    assert {(p.key, p.line) for p in problems} == {
        ("watch[1].mode", 5), ("watch[1].poll_interval", 6)}


def test_single_watch_table_problems_have_lines(tmp_path: Path) -> None:
    """A single [watch] table (not [[watch]]) is watch[0]; its problems still get a line."""
    problem = _one(tmp_path, '[watch]\ninput = "/srv/in"\nsettle_seconds = "x"\n')
    assert (problem.key, problem.line) == ("watch[0].settle_seconds", 3)


def test_watch_without_input_is_required(tmp_path: Path) -> None:
    """A [[watch]] table without input says it is required."""
    problem = _one(tmp_path, '[[watch]]\noutput = "/srv/out"\n')
    assert problem.key == "watch[0].input" and "required" in problem.message


def test_every_problem_reported_at_once(tmp_path: Path) -> None:
    """All problems in a file come back together, not one per run."""
    text = WATCH + '[engine]\nport = 0\nhost = 1\n[ocr]\nretries = -1\n'
    assert {p.key for p in _problems(tmp_path, text)} == {"engine.port", "engine.host",
                                                          "ocr.retries"}


def test_toml_syntax_error_has_line(tmp_path: Path) -> None:
    """Invalid TOML is one config_syntax problem with the line tomllib reports."""
    problem = _one(tmp_path, WATCH + "[engine]\nport = = 3\n")
    assert problem.code == "config_syntax" and problem.line == 4


def test_unreadable_file(tmp_path: Path) -> None:
    """A missing file is a config_unreadable problem, exit 78."""
    with pytest.raises(ConfigError) as info:
        config.load_config(tmp_path / "nope.toml")
    assert info.value.problems[0].code == "config_unreadable"
    assert info.value.exit_code == ExitCode.CONFIG


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    """`engine = 3` is reported as not a table."""
    problems = _problems(tmp_path, WATCH.replace("[[watch]]", "engine = 3\n[[watch]]"))
    assert [(p.key, p.code) for p in problems] == [("engine", "config_type")]


# ----------------------------------------------------------------------------- obsolete knobs


@pytest.mark.parametrize(
    ("section", "knob", "needle"),
    [
        ("[engine.memory]", "swap_space = 4", "0.18"),
        ("[engine.memory]", 'preemption_mode = "swap"', "V0"),
        ("[engine.memory]", "enable_memory_fragmentation_handler = true",
         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        ("[engine.memory]", "batch_size = 8", "max_num_seqs"),
        ("[engine]", "swap_space = 4", "recomputed"),
        ("[engine]", "batch_size = 8", "max_num_seqs"),
    ],
)
def test_obsolete_knob_names_replacement(
    tmp_path: Path, section: str, knob: str, needle: str
) -> None:
    """Recipe knobs vLLM lacks are refused with the real mechanism named."""
    problem = _one(tmp_path, f"{WATCH}{section}\n{knob}\n")
    assert problem.code == "engine_flag_obsolete"
    assert problem.line == 4
    assert needle in problem.message


def test_swap_space_key_says_which_vllm_has_the_flag(tmp_path: Path) -> None:
    """``swap_space`` is no key of chandrad's; its refusal says where the flag still is
    (vLLM 0.17 accepts ``--swap-space``, through ``engine.extra_args``, judged by
    ``engine.python``'s vLLM) instead of calling it gone."""
    problem = _one(tmp_path, f"{WATCH}[engine.memory]\nswap_space = 4\n")
    assert problem.code == "engine_flag_obsolete"
    assert "0.17 accepts --swap-space" in problem.message
    assert "engine.extra_args" in problem.message and "0.18 removed it" in problem.message


@pytest.mark.parametrize("value", ['"16MB"', '"2 MiB"', "2048", "7"])
def test_block_size_in_megabytes_refused(tmp_path: Path, value: str) -> None:
    """block_size as a size (or a non-vLLM number) explains it is tokens per KV block."""
    problem = _one(tmp_path, f"{WATCH}[engine.memory]\nblock_size = {value}\n")
    assert problem.key == "engine.memory.block_size" and problem.line == 4
    assert "tokens" in problem.message and "MB" in problem.message


# ----------------------------------------------------------------------------- cross checks


@pytest.mark.parametrize("name", ["output", "done", "failed"])
def test_output_inside_input_refused(tmp_path: Path, name: str) -> None:
    """output/done/failed inside a recursive input would be re-ingested: refused."""
    problem = _one(tmp_path, f'{WATCH}{name} = "/srv/in/{name}"\n')
    assert problem.key == f"watch[0].{name}" and problem.line == 3
    assert "inside the watched input" in problem.message


def test_output_equal_to_input_refused_even_non_recursive(tmp_path: Path) -> None:
    """The input folder itself can never be the output."""
    problem = _one(tmp_path, f'{WATCH}recursive = false\noutput = "/srv/in"\n')
    assert problem.key == "watch[0].output"


def test_subfolder_output_allowed_when_not_recursive(tmp_path: Path) -> None:
    """A non-recursive watch never scans subfolders, so output may live there."""
    cfg = config.load_config(_write(tmp_path, f'{WATCH}recursive = false\n'
                                              'output = "/srv/in/out"\n'))
    assert cfg.watch[0].output == Path("/srv/in/out")


TWO_WATCHES = ('[[watch]]\ninput = "/srv/a/in"\n'  # lines 1-2
               '[[watch]]\ninput = "{input}"\n'  # lines 3-4
               '{extra}')


def _two(tmp_path: Path, input: str, extra: str = "") -> list[ConfigProblem]:
    return _problems(tmp_path, TWO_WATCHES.format(input=input, extra=extra))


@pytest.mark.parametrize("name", ["output", "done", "failed"])
def test_folder_inside_another_watch_input_refused(tmp_path: Path, name: str) -> None:
    """watch[1]'s output/done/failed inside watch[0]'s input: watch[0] would ingest them."""
    [problem] = _two(tmp_path, "/srv/b/in", f'{name} = "/srv/a/in/sub/{name}"\n')
    assert (problem.key, problem.line, problem.code) == (f"watch[1].{name}", 5, "config_range")
    assert "inside the watched input /srv/a/in of watch[0].input (line 2)" in problem.message


def test_default_output_inside_another_watch_input_refused(tmp_path: Path) -> None:
    """watch[1] on /srv/a/in/x gets the default output /srv/a/in/output: inside watch[0]'s
    input twice over (the nested input is refused too)."""
    problems = _two(tmp_path, "/srv/a/in/x")
    keys = {p.key: p for p in problems}
    assert set(keys) == {"watch[1].input", "watch[1].output", "watch[1].done",
                         "watch[1].failed"}, problems
    assert keys["watch[1].output"].line == 3  # no output key: its [[watch]] table
    assert "both watches" in keys["watch[1].input"].message


def test_duplicate_input_refused(tmp_path: Path) -> None:
    """Two watches on one folder (any spelling): refused, naming both; exit 78."""
    [problem] = _two(tmp_path, "/srv/a/x/../in/", 'output = "/srv/b/out"\n'
                                                   'done = "/srv/b/done"\nfailed = "/srv/b/f"\n')
    assert (problem.key, problem.line) == ("watch[1].input", 4)
    assert "already watched by watch[0].input (line 2)" in problem.message


def test_input_inside_recursive_input_refused_beside_non_recursive_allowed(
    tmp_path: Path
) -> None:
    """A subfolder of a recursive watch is already watched; of a non-recursive one it is not."""
    folders = 'output = "/srv/b/out"\ndone = "/srv/b/done"\nfailed = "/srv/b/f"\n'
    [problem] = _two(tmp_path, "/srv/a/in/sub", folders)
    assert problem.key == "watch[1].input" and "both watches" in problem.message
    text = TWO_WATCHES.format(input="/srv/a/in/sub", extra=folders).replace(
        'input = "/srv/a/in"\n', 'input = "/srv/a/in"\nrecursive = false\n', 1)
    cfg = config.load_config(_write(tmp_path, text))
    assert [w.input for w in cfg.watch] == [Path("/srv/a/in"), Path("/srv/a/in/sub")]


def test_input_inside_another_watch_done_refused(tmp_path: Path) -> None:
    """An input inside watch[0]'s done/ would OCR every finished input again."""
    [problem] = _two(tmp_path, "/srv/a/done/again", 'output = "/srv/b/out"\n'
                                                     'done = "/srv/b/done"\n'
                                                     'failed = "/srv/b/f"\n')
    assert (problem.key, problem.line) == ("watch[1].input", 4)
    assert "the done folder of watch[0].done" in problem.message


def test_separate_watches_accepted(tmp_path: Path) -> None:
    """Two watches with their own folders side by side are fine (shared output is too)."""
    cfg = config.load_config(_write(tmp_path, TWO_WATCHES.format(input="/srv/a/in2", extra="")))
    assert cfg.watch[0].output == cfg.watch[1].output == Path("/srv/a/output")


def test_sibling_with_common_prefix_is_not_inside(tmp_path: Path) -> None:
    """/srv/in-done is beside /srv/in, not inside it (path, not string, comparison)."""
    cfg = config.load_config(_write(tmp_path, f'{WATCH}done = "/srv/in-done"\n'))
    assert cfg.watch[0].done == Path("/srv/in-done")


# ----------------------------------------------------------------------------- remote engine


def test_engine_url_means_unsupervised(tmp_path: Path) -> None:
    """[engine] url switches to a remote engine; base_url drops a trailing /v1."""
    cfg = config.load_config(_write(tmp_path, WATCH + '[engine]\nurl = "http://gpu1:8000/v1/"\n'))
    assert not cfg.engine.supervised
    assert cfg.engine.base_url == "http://gpu1:8000"


def test_engine_url_must_be_http(tmp_path: Path) -> None:
    """A URL without http(s):// is refused naming engine.url."""
    problem = _one(tmp_path, WATCH + '[engine]\nurl = "gpu1:8000"\n')
    assert (problem.key, problem.line) == ("engine.url", 4)


def test_engine_health_path_is_a_path(tmp_path: Path) -> None:
    """health_path defaults to vLLM's /health; "/readiness" (a router) is taken; a value
    that is not a path is refused naming engine.health_path."""
    assert config.load_config(_write(tmp_path, WATCH)).engine.health_path == "/health"
    cfg = config.load_config(_write(tmp_path, WATCH + '[engine]\nurl = "http://r:30000"\n'
                                    'health_path = "/readiness"\n'))
    assert cfg.engine.health_path == "/readiness"
    problem = _one(tmp_path, WATCH + '[engine]\nhealth_path = "readiness"\n')
    assert (problem.key, problem.line) == ("engine.health_path", 4)


# ----------------------------------------------------------------------------- helpers


def test_default_config_path_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CHANDRAD_CONFIG wins; without it /etc/chandrad/chandrad.toml."""
    monkeypatch.setenv("CHANDRAD_CONFIG", "/tmp/x.toml")
    assert config.default_config_path() == Path("/tmp/x.toml")
    monkeypatch.delenv("CHANDRAD_CONFIG")
    assert config.default_config_path() == Path("/etc/chandrad/chandrad.toml")


def test_control_socket_under_systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$RUNTIME_DIRECTORY/control.sock under systemd, else control.socket."""
    cfg = config.load_config(_write(tmp_path, WATCH))
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    assert cfg.control_socket() == Path("/run/chandrad/control.sock")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/x:/run/y")
    assert cfg.control_socket() == Path("/run/x/control.sock")


def test_engine_settings_changed(tmp_path: Path) -> None:
    """Only a change under [engine] requires an engine restart on reload."""
    a = config.load_config(_write(tmp_path, WATCH))
    b = config.load_config(_write(tmp_path, WATCH + "[ocr]\nretries = 2\n"))
    c = config.load_config(_write(tmp_path, WATCH + "[engine.memory]\nmax_num_seqs = 2\n"))
    assert not config.engine_settings_changed(a, b)
    assert config.engine_settings_changed(a, c)


def test_dataclass_dict_is_json(tmp_path: Path) -> None:
    """dataclass_dict gives a JSON-serialisable nested dict."""
    cfg = config.load_config(_write(tmp_path, WATCH))
    data = json.loads(json.dumps(config.dataclass_dict(cfg)))
    assert data["engine"]["memory"]["max_num_seqs"] == "auto"
    assert data["watch"][0]["input"] == "/srv/in"


def test_key_line_walks_up_to_enclosing_table() -> None:
    """key_line finds a key, else its section header, else None."""
    text = "[engine]\nport = 1\n[engine.memory]\nmax_num_seqs = 2\n"
    assert config.key_line(text, "engine.port") == 2
    assert config.key_line(text, "engine.memory.max_num_seqs") == 4
    assert config.key_line(text, "engine.memory.block_size") == 3
    assert config.key_line(text, "ocr.retries") is None


# ----------------------------------------------------------------------------- shipped file


def _leaf_keys(cls: type, prefix: str) -> set[str]:
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        if config.DERIVED in f.metadata:
            continue  # not a key of its own (engine.urls is what engine.url holds)
        sub = f.type if isinstance(f.type, type) else getattr(config, str(f.type), None)
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            keys |= _leaf_keys(sub, f"{prefix}.{f.name}")
        else:
            keys.add(f"{prefix}.{f.name}")
    return keys


def _documented_keys(text: str) -> set[str]:
    """Keys written in the file, commented out or not, under their section."""
    keys: set[str] = set()
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        header = re.match(r"^\[\[?([a-z.]+)\]\]?", line)
        if header:
            section = header.group(1)
            continue
        key = re.match(r"^#?\s*([a-z_]+)\s*=", line)
        if key and section:
            keys.add(f"{section}.{key.group(1)}")
    return keys


def test_shipped_config_loads() -> None:
    """etc/chandrad.toml is a valid config and matches the built-in defaults."""
    cfg = config.load_config(SHIPPED)
    assert cfg.daemon == config.DaemonConfig()
    assert cfg.ocr == config.OcrConfig()
    assert cfg.engine == config.EngineConfig()
    assert cfg.control == config.ControlConfig()
    assert cfg.metrics == config.MetricsConfig()
    assert cfg.api == config.ApiConfig() and cfg.api_watch() is None
    watch = cfg.watch[0]
    defaults = config.WatchConfig(input=watch.input, output=watch.input.parent / "output",
                                  done=watch.input.parent / "done",
                                  failed=watch.input.parent / "failed")
    assert watch == defaults


def test_shipped_config_documents_every_field() -> None:
    """Every field of every config dataclass appears in etc/chandrad.toml, so docs cannot drift."""
    text = SHIPPED.read_text(encoding="utf-8")
    documented = _documented_keys(text)
    sections = {
        "daemon": config.DaemonConfig, "watch": config.WatchConfig, "ocr": config.OcrConfig,
        "engine": config.EngineConfig, "control": config.ControlConfig,
        "metrics": config.MetricsConfig, "api": config.ApiConfig,
    }
    expected: set[str] = set()
    for name, cls in sections.items():
        expected |= _leaf_keys(cls, name)
    # backoff_initial/backoff_max are written as one `backoff = [initial, max]` pair.
    expected -= {"engine.downshift.backoff_initial", "engine.downshift.backoff_max"}
    expected.add("engine.downshift.backoff")
    missing = sorted(expected - documented)
    assert not missing, f"etc/chandrad.toml does not document: {missing}"
    assert "engine.memory.gpu_memory_utilization" in expected  # the introspection recursed
    unknown = sorted(documented - expected)
    assert not unknown, f"etc/chandrad.toml documents keys config.py lacks: {unknown}"


def test_shipped_config_every_key_has_a_comment() -> None:
    """Each documented key line carries a one-line comment."""
    for line in SHIPPED.read_text(encoding="utf-8").splitlines():
        if re.match(r"^#?\s*[a-z_]+\s*=", line.strip()):
            assert re.search(r"\S\s+#\s*\S", line), f"no comment on: {line}"


# ----------------------------------------------------------------------------- [api]
def test_api_is_off_by_default_and_its_folders_live_in_the_state_dir_or_api_folder(
        tmp_path: Path) -> None:
    cfg = config.load_config(_write(tmp_path, WATCH))
    assert not cfg.api.enabled and cfg.api_watch() is None
    on = config.load_config(_write(tmp_path, WATCH + '[daemon]\nstate_dir = "/srv/st"\n'
                                   '[api]\nenabled = true\ntokens_file = "tok"\n'))
    assert on.api.listen == "127.0.0.1:9479" and on.api.tokens_file == tmp_path / "tok"
    watch = on.api_watch()
    assert watch is not None and watch.input == Path("/srv/st/api/inbox")
    assert watch.output == Path("/srv/st/api/output")
    shared = config.load_config(_write(tmp_path, WATCH + '[daemon]\nstore = '
                                       '"postgresql://db/chandrad"\n[api]\nenabled = true\n'
                                       'tokens_file = "tok"\nfolder = "/spool/api"\n'))
    watch = shared.api_watch()
    assert watch is not None and watch.input == Path("/spool/api/inbox")


def test_api_callback_hosts_default_to_the_callback_urls_host(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s")
    hooked = '[api]\nwebhook_secret_file = "secret"\ncallback_url = "https://u@Hooks.Example:8443/x"\n'
    assert config.load_config(_write(tmp_path, WATCH + hooked)).api.callback_hosts == (
        "hooks.example",)
    assert config.load_config(_write(tmp_path, WATCH)).api.callback_hosts == ()
    listed = '[api]\ncallback_hosts = ["*.Corp.example", "10.0.0.5", "[fd00::5]"]\n'
    assert config.load_config(_write(tmp_path, WATCH + listed)).api.callback_hosts == (
        "*.corp.example", "10.0.0.5", "fd00::5")


def test_api_formats_unset_follow_what_the_pipeline_writes(tmp_path: Path) -> None:
    """A config that narrows ``ocr.formats`` and says nothing of ``[api]`` loads (the API
    is off), and a job's default outputs are the pipeline's."""
    narrowed = '[ocr]\nformats = ["md", "json"]\n'
    cfg = config.load_config(_write(tmp_path, WATCH + narrowed))
    assert cfg.api.formats == ("md", "json")


@pytest.mark.parametrize(("text", "key"), [
    ("[api]\nenabled = true\n", "api.tokens_file"),
    ('[api]\nlisten = "nowhere"\n', "api.listen"),
    ('[api]\nformats = ["pdf"]\n', "api.formats"),
    ('[ocr]\nformats = ["md"]\n[api]\nformats = ["md", "html"]\n', "api.formats"),
    ('[api]\ncallback_url = "ftp://x"\n', "api.callback_url"),
    ('[api]\ncallback_url = "http://x/hook"\n', "api.webhook_secret_file"),
    ("[api]\nmax_upload = 0\n", "api.max_upload"),
    ('[api]\nduplicates = "merge"\n', "api.duplicates"),
    ('[api]\ncallback_hosts = ["http://x/"]\n', "api.callback_hosts"),
    ('[api]\ncallback_hosts = "x.example"\n', "api.callback_hosts"),
    ("[api]\ntoken = 1\n", "api.token"),
    ('[daemon]\nstore = "postgresql://db/chandrad"\n[api]\nenabled = true\n'
     'tokens_file = "t"\n', "api.folder"),
    ('[api]\nenabled = true\ntokens_file = "t"\nfolder = "/srv"\n', "api.folder"),
])
def test_api_problems_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    problem = _one(tmp_path, WATCH + text)
    assert problem.key == key and problem.line is not None
