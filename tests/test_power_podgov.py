"""The stock governors' models (SIMULATION): nvhost_podgov and schedutil, as their sources
behave."""

from __future__ import annotations

import itertools

from power.sim.cpugov import Schedutil
from power.sim.podgov import Podgov, PodgovTunables

GPU_HZ = (306000000, 408000000, 510000000, 612000000, 714000000, 816000000, 918000000,
          1020000000)
CPU_KHZ = (115200, 729600, 1036800, 1344000, 1728000)


def _run(podgov: Podgov, freq: int, busy_share: float, samples: int, *, start_s: float = 0.0,
         low: int = GPU_HZ[0], high: int = GPU_HZ[-1]) -> list[int]:
    """Sample every 25 ms; the new request is in force for the next sample (as if instantly)."""
    seen = []
    for index in range(samples):
        freq = podgov.sample(now_s=start_s + 0.025 * (index + 1), busy_share=busy_share,
                             freq_hz=freq, table_hz=GPU_HZ, min_hz=low, max_hz=high,
                             railgated=False)
        seen.append(freq)
    return seen


def test_light_load_parks_podgov_at_the_lowest_clock() -> None:
    # 5 Hz of 8 ms jobs: a 4 % busy GPU; podgov targets 70 %, so it walks down to the floor.
    seen = _run(Podgov(), GPU_HZ[-1], 0.04, 40)
    assert seen[-1] == GPU_HZ[0]
    assert seen.index(GPU_HZ[0]) <= 12  # down within a few block windows, not minutes


def test_saturation_reaches_the_top_in_two_undamped_jumps() -> None:
    seen = _run(Podgov(), GPU_HZ[0], 1.0, 8)
    changes = [freq for previous, freq in zip([GPU_HZ[0], *seen], seen) if freq != previous]
    # max/3 = 340 MHz a jump: 306 -> 646 (rounded up to 714) -> 1054 (clamped to 1020).
    assert changes == [714000000, GPU_HZ[-1]]
    assert seen.index(GPU_HZ[-1]) <= 3  # the second jump one block window (50 ms) later


def test_changes_are_at_least_one_block_window_apart() -> None:
    podgov = Podgov()
    freq = GPU_HZ[0]
    change_times = []
    for index in range(40):
        now = 0.025 * (index + 1)
        new = podgov.sample(now_s=now, busy_share=1.0 if index < 20 else 0.0, freq_hz=freq,
                            table_hz=GPU_HZ, min_hz=GPU_HZ[0], max_hz=GPU_HZ[-1],
                            railgated=False)
        if new != freq:
            change_times.append(now)
        freq = new
    gaps = [b - a for a, b in itertools.pairwise(change_times)]
    assert change_times and all(gap >= PodgovTunables().block_window_s - 1e-9 for gap in gaps)


def test_moderate_load_settles_where_busyness_is_near_the_target() -> None:
    # A GPU busy 50 % at the top clock does the same work 70 % busy near 714 MHz.
    podgov = Podgov()
    freq = GPU_HZ[-1]
    work = 0.5 * GPU_HZ[-1]  # Hz of work per second
    for index in range(200):
        busy = min(1.0, work / freq)
        freq = podgov.sample(now_s=0.025 * (index + 1), busy_share=busy, freq_hz=freq,
                             table_hz=GPU_HZ, min_hz=GPU_HZ[0], max_hz=GPU_HZ[-1],
                             railgated=False)
    assert 612000000 <= freq <= 816000000


def test_limits_clamp_the_choice_and_a_min_above_the_max_gives_way() -> None:
    assert _run(Podgov(), GPU_HZ[0], 1.0, 6, high=612000000)[-1] == 612000000
    assert _run(Podgov(), GPU_HZ[-1], 0.0, 20, low=510000000)[-1] == 510000000
    # min 918 > max 510 (r35+ semantics): the max wins.
    assert _run(Podgov(), GPU_HZ[-1], 1.0, 4, low=918000000, high=510000000)[-1] == 510000000


def test_requests_round_up_to_a_table_entry() -> None:
    for freq in _run(Podgov(), GPU_HZ[-1], 0.3, 40):
        assert freq in GPU_HZ


def test_a_railgated_gpu_is_held_at_the_minimum() -> None:
    podgov = Podgov()
    freq = podgov.sample(now_s=1.0, busy_share=0.0, freq_hz=GPU_HZ[-1], table_hz=GPU_HZ,
                         min_hz=408000000, max_hz=GPU_HZ[-1], railgated=True)
    assert freq == 408000000


def _schedutil(busy_share: float, ticks: int, freq: int = 729600, *, low: int = 729600,
               high: int = CPU_KHZ[-1]) -> list[int]:
    governor = Schedutil()
    seen = []
    for index in range(ticks):
        freq = governor.update(now_s=0.01 * (index + 1), interval_s=0.01, busy_share=busy_share,
                               freq_khz=freq, table_khz=CPU_KHZ, min_khz=low, max_khz=high)
        seen.append(freq)
    return seen


def test_schedutil_runs_a_busy_core_at_the_top_and_an_idle_one_at_the_floor() -> None:
    assert _schedutil(1.0, 60)[-1] == CPU_KHZ[-1]
    assert _schedutil(0.01, 60, freq=CPU_KHZ[-1])[-1] == 729600  # scaling_min_freq
    # A 10 % launch thread at the floor is little invariant work: schedutil stays low.
    assert _schedutil(0.10, 100)[-1] <= 1036800


def test_schedutil_ramps_with_pelt_not_at_once() -> None:
    seen = _schedutil(1.0, 30)
    assert seen[0] < CPU_KHZ[-1]  # one 10 ms tick of load does not reach the top
    assert seen[-1] == CPU_KHZ[-1]
    assert sorted(seen) == seen  # monotonic under constant load


def test_schedutil_respects_its_limits() -> None:
    assert _schedutil(1.0, 60, high=1036800)[-1] == 1036800
    assert _schedutil(0.0, 60, freq=CPU_KHZ[-1], low=1344000)[-1] == 1344000
