"""Placing engines: NVML's per-GPU facts + ``[engine]`` → replica specs.

The planner is pure; the GPU facts are what NVML reports on hosts with 1, 2 and 8 cards
(machines with several GPUs are not lent here). The specs are then turned into the real
engine command (``build_engine_command``) to check what each replica's process gets.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from chandrad.config import EngineConfig, load_config
from chandrad.engine.command import build_engine_command
from chandrad.engine.profile import MemoryProfile
from chandrad.engine.replicas import GpuSlot, plan_replicas
from chandrad.errors import ConfigError

H100 = 85_520_809_984  # 81559 MiB, as NVML reports an "80 GB" H100


def gpus(n: int) -> list[GpuSlot]:
    return [GpuSlot(i, f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}", H100) for i in range(n)]


def env_of(engine: EngineConfig) -> dict[str, str]:
    return build_engine_command(engine, MemoryProfile(), base_env={}).env


def flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_no_gpu_one_engine_is_the_configured_engine() -> None:
    engine = EngineConfig()
    [spec] = plan_replicas(engine, [])
    assert spec.id == "0" and spec.engine is engine and spec.gpus == () and spec.cpus == ""


@pytest.mark.parametrize("n", [1, 2, 8])
def test_one_engine_per_gpu_pinned_by_uuid_on_its_own_port(n: int) -> None:
    cards = gpus(n)
    specs = plan_replicas(EngineConfig(port=8000), cards)
    assert [s.id for s in specs] == [str(i) for i in range(n)]
    assert [s.engine.port for s in specs] == [8000 + i for i in range(n)]
    assert [s.url for s in specs] == [f"http://127.0.0.1:{8000 + i}" for i in range(n)]
    for spec, card in zip(specs, cards, strict=True):
        assert spec.gpus == (card.uuid,)
        assert env_of(spec.engine)["CUDA_VISIBLE_DEVICES"] == card.uuid
        argv = build_engine_command(spec.engine, MemoryProfile(), base_env={}).argv
        assert flag(argv, "--port") == str(spec.engine.port)
        assert "--tensor-parallel-size" not in argv


def test_tensor_parallel_groups_gpus_per_replica() -> None:
    cards = gpus(8)
    specs = plan_replicas(EngineConfig(tensor_parallel_size=2), cards)
    assert [s.gpus for s in specs] == [(cards[i].uuid, cards[i + 1].uuid)
                                       for i in range(0, 8, 2)]
    argv = build_engine_command(specs[3].engine, MemoryProfile(), base_env={}).argv
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert env_of(specs[3].engine)["CUDA_VISIBLE_DEVICES"] == f"{cards[6].uuid},{cards[7].uuid}"
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size"):
        plan_replicas(EngineConfig(tensor_parallel_size=4), gpus(2))


def test_replicas_caps_the_count_and_more_than_the_gpus_is_refused() -> None:
    cards = gpus(8)
    specs = plan_replicas(EngineConfig(replicas=3), cards)
    assert [s.gpus for s in specs] == [(c.uuid,) for c in cards[:3]]
    with pytest.raises(ConfigError, match="engine.replicas"):
        plan_replicas(EngineConfig(replicas=3), gpus(2))


def test_gpus_subset_places_engines_on_the_selected_cards_only() -> None:
    """engine.gpus selects (gpu.select, in the daemon); the planner gets the selection."""
    cards = gpus(8)
    chosen = [cards[5], cards[2]]  # in NVML order whatever the selector's order
    specs = plan_replicas(EngineConfig(gpus="5,2"), chosen)
    assert [s.gpus for s in specs] == [(cards[2].uuid,), (cards[5].uuid,)]
    assert [s.engine.port for s in specs] == [8000, 8001]


def test_data_parallel_is_one_engine_over_every_gpu() -> None:
    cards = gpus(4)
    [spec] = plan_replicas(EngineConfig(layout="data_parallel"), cards)
    argv = build_engine_command(spec.engine, MemoryProfile(), base_env={}).argv
    assert flag(argv, "--data-parallel-size") == "4"
    assert env_of(spec.engine)["CUDA_VISIBLE_DEVICES"] == ",".join(c.uuid for c in cards)
    [tp] = plan_replicas(EngineConfig(layout="data_parallel", tensor_parallel_size=2), cards)
    argv = build_engine_command(tp.engine, MemoryProfile(), base_env={}).argv
    assert (flag(argv, "--data-parallel-size"), flag(argv, "--tensor-parallel-size")) == ("2", "2")


def test_cpu_affinity_gives_one_pinned_replica_per_cpu_list() -> None:
    specs = plan_replicas(EngineConfig(cpu_affinity=("0", "1")), [])
    assert [(s.id, s.cpus, s.engine.port) for s in specs] == [("0", "0", 8000), ("1", "1", 8001)]
    argv = build_engine_command(specs[1].engine, MemoryProfile(), base_env={},
                                cpus=specs[1].cpus).argv
    assert argv[:3] == ("taskset", "-c", "1")
    assert "CUDA_VISIBLE_DEVICES" not in env_of(specs[1].engine)
    one = plan_replicas(EngineConfig(replicas=1, cpu_affinity=("2-3",)), [])
    assert [(s.id, s.cpus) for s in one] == [("0", "2-3")]


def test_urls_are_remote_engines_never_spawned() -> None:
    engine = EngineConfig(url="http://a:8000", urls=("http://a:8000", "http://b:8000/v1"))
    specs = plan_replicas(engine, gpus(2))
    assert [(s.id, s.url, s.supervised) for s in specs] == [
        ("0", "http://a:8000", False), ("1", "http://b:8000", False)]


def _load(tmp_path: Path, engine: str) -> EngineConfig:
    path = tmp_path / "c.toml"
    path.write_text(f"[[watch]]\ninput = \"{tmp_path}/in\"\n[engine]\n{engine}\n")
    return load_config(path).engine


@pytest.mark.parametrize(("text", "key"), [
    ('cpu_affinity = ["0", "x"]', "engine.cpu_affinity"),
    ('replicas = 3\ncpu_affinity = ["0", "1"]', "engine.cpu_affinity"),
    ("replicas = -1", "engine.replicas"),
    ("tensor_parallel_size = 0", "engine.tensor_parallel_size"),
    ('layout = "mesh"', "engine.layout"),
    ('url = ["http://a:1", "ftp://b"]', "engine.url"),
    ("url = []", "engine.url"),
    ('url = ["http://a:1"]\nreplicas = 2', "engine.url"),
    ('tensor_parallel_size = 2\nextra_args = ["--tensor-parallel-size", "2"]',
     "engine.extra_args"),
    ('port = 65535\nreplicas = 2', "engine.port"),
])
def test_bad_layout_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    assert key in {p.key for p in err.value.problems}, err.value.message


def test_url_list_loads(tmp_path: Path) -> None:
    engine = _load(tmp_path, 'url = ["http://a:1/v1", "http://b:2"]')
    assert engine.urls == ("http://a:1/v1", "http://b:2") and engine.url == "http://a:1/v1"
    assert replace(engine, urls=()).base_url == "http://a:1"
