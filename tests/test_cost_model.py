"""The alpha-beta model shows where each allreduce algorithm wins."""

import pytest

from coordinator.cost_model import GBIT, hierarchical_time, ring_time, simulate, torus_time


def test_on_one_host_every_algorithm_is_the_intra_host_ring():
    n = 1e6
    assert ring_time(8, 8, n, 10 * GBIT) == pytest.approx(
        torus_time(8, 8, n, 10 * GBIT), rel=0.05)


def test_small_messages_at_scale_favour_the_host_aware_algorithms():
    (row,) = simulate(ranks=(4096,), gbits=(100,), size_bytes=64e3)
    _, _, times, winner = row
    assert winner == "hierarchical"
    assert times["ring"] > 5 * times["hierarchical"]  # 2(P-1) vs 2(H-1) latencies


def test_large_messages_on_fast_hosts_favour_the_torus():
    (row,) = simulate(ranks=(1024,), gbits=(25,), size_bytes=100e6, beta_intra=150e9)
    assert row[3] == "torus"


def test_large_messages_on_pcie_hosts_with_a_fast_network_favour_the_ring():
    (row,) = simulate(ranks=(64,), gbits=(100,), size_bytes=100e6, beta_intra=12e9)
    assert row[3] == "ring"


def test_times_grow_with_size_and_shrink_with_bandwidth():
    for fn in (ring_time, hierarchical_time, torus_time):
        assert fn(256, 8, 2e6, 10 * GBIT) > fn(256, 8, 1e6, 10 * GBIT)
        assert fn(256, 8, 1e6, 100 * GBIT) < fn(256, 8, 1e6, 10 * GBIT)


def test_cycle_negotiation_stays_flat_where_request_lists_grow_with_the_ranks():
    from coordinator import cost_model as cm

    streamed = [cm.streamed_negotiation(p, 161) for p in (64, 1024, 4096)]
    cycles = [cm.cycle_negotiation(p, 161) for p in (64, 1024, 4096)]
    assert streamed[2] / streamed[0] > 50  # linear in the ranks
    assert cycles[2] / cycles[0] < 1.5  # only the log grows
    assert all(c < s / 10 for c, s in zip(cycles, streamed))
