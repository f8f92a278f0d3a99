"""bench/offcpu.py: a context-switch recording read back as time off the CPU.

The text is what ``perf script -F comm,pid,tid,time,event,trace,ip,sym`` printed for a
``perf record -e sched:sched_switch -g -a -k mono`` on this machine (addresses kept, the
user-space frames cut short).
"""

from __future__ import annotations

import pytest

from bench.offcpu import Switch, beside_slowest, by_stack, parse, report, stretches
from bench.tails import Sample

REPLICA, HOST, OTHER = 4321, 5000, 777

RECORDING = f"""\
ray::ServeRepli {REPLICA}/{REPLICA}  100.000000: sched:sched_switch: prev_comm=ray::ServeRepli \
prev_pid={REPLICA} prev_prio=120 prev_state=D ==> next_comm=swapper/0 next_pid=0 next_prio=120
\tffffffff82258a08 __schedule
\tffffffff82259373 schedule
\tffffffff813fa1b2 synchronize_rcu
\tffffffff816a0c11 expand_files
\tffffffff816a0d42 alloc_fd
\tffffffff81690e10 do_sys_openat2
\tffffffff8224d141 do_syscall_64
\tffffffff81000130 entry_SYSCALL_64_after_hwframe
\t           ee137 __open64@@GLIBC_2.2.5

swapper/0     0/0      100.001000: sched:sched_switch: prev_comm=swapper/0 prev_pid=0 \
prev_prio=120 prev_state=R ==> next_comm=other next_pid={OTHER} next_prio=120
\tffffffff82258a08 __schedule

other       {OTHER}/{OTHER}  100.002000: sched:sched_switch: prev_comm=other prev_pid={OTHER} \
prev_prio=120 prev_state=S ==> next_comm=torpor-files next_pid={REPLICA + 1} next_prio=120
\tffffffff82258a08 __schedule

torpor-files {REPLICA}/{REPLICA + 1}  100.003000: sched:sched_switch: prev_comm=torpor-files \
prev_pid={REPLICA + 1} prev_prio=120 prev_state=R+ ==> next_comm=other next_pid={OTHER} \
next_prio=120
\tffffffff82258a08 __schedule
\tffffffff8225a001 preempt_schedule_common
\tffffffff81401234 __cond_resched
\tffffffff81555555 ext4_find_entry

other       {OTHER}/{OTHER}  100.009400: sched:sched_switch: prev_comm=other prev_pid={OTHER} \
prev_prio=120 prev_state=S ==> next_comm=ray::ServeRepli next_pid={REPLICA} next_prio=120
\tffffffff82258a08 __schedule

ray::ServeRepli {REPLICA}/{REPLICA}  100.010000: sched:sched_switch: prev_comm=ray::ServeRepli \
prev_pid={REPLICA} prev_prio=120 prev_state=S ==> next_comm=ray::PoolHost next_pid={HOST} \
next_prio=120
\tffffffff82258a08 __schedule
\tffffffff81777777 ep_poll

ray::PoolHost  {HOST}/{HOST}  100.010500: sched:sched_switch: prev_comm=ray::PoolHost \
prev_pid={HOST} prev_prio=120 prev_state=D ==> next_comm=torpor-files next_pid={REPLICA + 1} \
next_prio=120
\tffffffff82258a08 __schedule
\tffffffff81888888 bit_wait_io
\tffffffff81999999 __ext4_find_entry
"""


@pytest.fixture
def switches() -> list[Switch]:
    return parse(RECORDING)


def test_each_switch_is_read_with_its_state_and_kernel_stack_past_the_scheduler(
    switches: list[Switch],
) -> None:
    first = switches[0]
    assert (first.at_ms, first.pid, first.tid, first.state, first.next_tid) == (
        100_000.0,
        REPLICA,
        REPLICA,
        "D",
        0,
    )
    # The scheduler's own frames are not named; the stack ends at the syscall entry.
    assert first.stack == ("synchronize_rcu", "expand_files", "alloc_fd", "do_sys_openat2")
    preempted = switches[3]
    assert (preempted.tid, preempted.state, preempted.stack) == (
        REPLICA + 1,
        "R",
        ("ext4_find_entry",),
    )
    assert len(switches) == 7


def test_a_stretch_runs_from_a_threads_switch_out_to_its_switch_back_in(
    switches: list[Switch],
) -> None:
    found = stretches(switches, {REPLICA})
    by_tid = {(s.tid, s.state): s for s in found}
    # The replica's main thread: out at 100.000 (D, the descriptor table), back at 100.0094.
    main = by_tid[(REPLICA, "D")]
    assert main.ms == pytest.approx(9.4)
    assert main.stack[0] == "synchronize_rcu"
    # Its worker thread: preempted at 100.003, back at 100.0105.
    assert by_tid[(REPLICA + 1, "R")].ms == pytest.approx(7.5)
    # Not watched: the other process and the pool host; the main thread's last switch
    # (to the pool host) has no switch back in the recording, so it is left out.
    assert {s.pid for s in found} == {REPLICA}
    assert len(found) == 2


def test_a_window_clips_the_stretches_and_drops_those_outside_it(
    switches: list[Switch],
) -> None:
    found = stretches(switches, {REPLICA}, window=(100_005.0, 100_009.0))
    assert sorted(round(s.ms, 3) for s in found) == [4.0, 4.0]
    assert stretches(switches, {REPLICA}, window=(200_000.0, 200_001.0)) == []


def test_stretches_sum_by_state_and_stack_longest_first(
    switches: list[Switch],
) -> None:
    found = stretches(switches, {REPLICA, HOST})
    stacks = by_stack(found)
    assert [stack[:2] for stack, _ in stacks] == [
        ("D", "synchronize_rcu"),
        ("R", "ext4_find_entry"),
    ]
    assert stacks[0][1].count == 1 and stacks[0][1].longest_ms == pytest.approx(9.4)
    # A sleep the thread asked for is not a wait on the kernel: not listed.
    assert by_stack(found, states="S") == []
    lines = report(found, {REPLICA: "replica"}, 1000.0)
    assert lines[0].startswith(f"replica (pid {REPLICA}), 1.0 s: D 9 ms, R 8 ms")
    assert "synchronize_rcu <- expand_files" in lines[1]


def test_the_slowest_webhooks_are_shown_with_the_waits_inside_their_span(
    switches: list[Switch],
) -> None:
    found = stretches(switches, {REPLICA})
    samples = [
        Sample("idle", "resume", sent_ms=99_999.0, accept_ms=3.0, step_ms=12.0),
        Sample("idle", "resume", sent_ms=100_020.0, accept_ms=2.0, step_ms=3.0),
    ]
    lines = beside_slowest(found, samples, {REPLICA: "replica"}, worst=1)
    assert lines[0] == "idle, resume: the 1 slowest"
    assert lines[1].strip().startswith("12.0 ms sent at 99999.0")
    assert f"replica/{REPLICA} D 9.40 ms: synchronize_rcu" in lines[2]
    assert len(lines) == 4  # the two waits inside the slowest one's span, nothing else
