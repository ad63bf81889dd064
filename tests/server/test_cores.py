"""The cores and memory servex may use, read from cgroup files laid out as the kernel lays them out (v1 and v2),
in a folder the test makes."""

from __future__ import annotations

from pathlib import Path

from servex.server.cores import cgroup_cpu_limit, cgroup_memory_limit


def _tree(root: Path, files: dict[str, str], proc_cgroup: str) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = root / "proc-self-cgroup"
    proc.write_text(proc_cgroup)
    return proc


def test_v2_memory_max_of_the_process_cgroup(tmp_path):
    proc = _tree(tmp_path, {"kubepods/pod1/memory.max": "1073741824\n", "kubepods/memory.max": "max\n"},
                 "0::/kubepods/pod1\n")  # fmt: skip
    assert cgroup_memory_limit(tmp_path, proc) == 1 << 30


def test_a_tighter_limit_above_binds_the_cgroup_below(tmp_path):
    proc = _tree(tmp_path, {"a/b/memory.max": "max\n", "a/memory.max": "536870912\n"}, "0::/a/b\n")
    assert cgroup_memory_limit(tmp_path, proc) == 512 << 20


def test_v1_limit_in_bytes_and_its_no_limit_value(tmp_path):
    proc = _tree(tmp_path, {"memory/job/memory.limit_in_bytes": "2147483648\n"},
                 "4:memory:/job\n2:cpu,cpuacct:/job\n")  # fmt: skip
    assert cgroup_memory_limit(tmp_path, proc) == 2 << 30
    (tmp_path / "memory/job/memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert cgroup_memory_limit(tmp_path, proc) is None


def test_no_memory_controller_means_no_limit(tmp_path):
    proc = _tree(tmp_path, {"cpu/job/cpu.cfs_quota_us": "150000\n", "cpu/job/cpu.cfs_period_us": "100000\n"},
                 "2:cpu:/job\n")  # fmt: skip
    assert cgroup_memory_limit(tmp_path, proc) is None
    assert cgroup_cpu_limit(tmp_path, proc) == 1.5


def test_inside_a_container_the_mounted_root_is_the_process_cgroup(tmp_path):
    proc = _tree(tmp_path, {"memory.max": "268435456\n", "cpu.max": "200000 100000\n"}, "0::/\n")
    assert cgroup_memory_limit(tmp_path, proc) == 256 << 20
    assert cgroup_cpu_limit(tmp_path, proc) == 2.0
