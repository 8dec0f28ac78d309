"""An alpha-beta cost model of allreduce algorithms across many hosts.

    python -m coordinator.cost_model [--size-mb 100] [--local-size 8]

Sending m bytes over a link costs alpha + m / beta. With P ranks on H hosts
of L ranks each (P = H * L), one network interface per host, and an allreduce
of n bytes:

- ring (flat, over all P ranks, hosts contiguous on the ring): 2 (P - 1)
  steps of n / P bytes; every step crosses the slowest (inter-host) link:
      2 (P - 1) (alpha_inter + n / (P beta_inter))
- hierarchical (reduce in the host along a binary tree, ring allreduce among
  the H host leaders, broadcast in the host):
      2 ceil(log2 L) (alpha_intra + n / beta_intra)
      + 2 (H - 1) (alpha_inter + n / (H beta_inter))
- 2D torus (rows are hosts, columns the same local rank on every host:
  reduce-scatter along the row, allreduce along the column, allgather along
  the row; the L column rings of a host share its interface):
      2 (L - 1) (alpha_intra + n / (L beta_intra))
      + 2 (H - 1) (alpha_inter + n / (H beta_inter))

Each host's interface carries about 2n bytes in every algorithm, but the
flat ring makes all 2 (P - 1) of its steps wait on the network, so with few
hosts it moves twice what the torus moves there, and at scale it pays
2 (P - 1) network latencies where the others pay 2 (H - 1). Hierarchical and
torus pay for that with extra passes inside the host: cheap on NVLink-class
hosts, dear when the host's links (PCIe) are no faster than the network, where
the flat ring wins for large messages.
"""

import argparse
import math

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

# Defaults: an NVLink-class host (150 GB/s, 2 us) and a network whose
# latency is 5 us per message.
ALPHA_INTRA = 2e-6
BETA_INTRA = 150e9
ALPHA_INTER = 5e-6


def ring(P, n, alpha, beta):
    if P <= 1:
        return 0.0
    return 2 * (P - 1) * (alpha + n / (P * beta))


def ring_time(P, L, n, beta_inter, alpha_inter=ALPHA_INTER, alpha_intra=ALPHA_INTRA,
              beta_intra=BETA_INTRA):
    if P <= L:  # one host: the ring stays inside it
        return ring(P, n, alpha_intra, beta_intra)
    return ring(P, n, alpha_inter, beta_inter)


def hierarchical_time(P, L, n, beta_inter, alpha_inter=ALPHA_INTER, alpha_intra=ALPHA_INTRA,
                      beta_intra=BETA_INTRA):
    H = max(1, P // L)
    tree = 2 * math.ceil(math.log2(L)) * (alpha_intra + n / beta_intra) if L > 1 else 0.0
    return tree + ring(H, n, alpha_inter, beta_inter)


def torus_time(P, L, n, beta_inter, alpha_inter=ALPHA_INTER, alpha_intra=ALPHA_INTRA,
               beta_intra=BETA_INTRA):
    H = max(1, P // L)
    rows = 2 * (L - 1) * (alpha_intra + n / (L * beta_intra)) if L > 1 else 0.0
    return rows + ring(H, n, alpha_inter, beta_inter)


ALGORITHMS = {"ring": ring_time, "hierarchical": hierarchical_time, "torus": torus_time}


HOSTS = {"NVLink host (150 GB/s)": 150e9, "PCIe host (12 GB/s)": 12e9}


def simulate(ranks=(16, 64, 256, 1024, 4096), gbits=(1, 10, 25, 100), size_bytes=100e6,
             local_size=8, beta_intra=BETA_INTRA):
    """Rows of (P, Gbit/s, {algorithm: seconds}, winner)."""
    rows = []
    for P in ranks:
        for g in gbits:
            times = {name: fn(P, local_size, size_bytes, g * GBIT, beta_intra=beta_intra)
                     for name, fn in ALGORITHMS.items()}
            rows.append((P, g, times, min(times, key=times.get)))
    return rows


def markdown(size_bytes, local_size, ranks=(16, 64, 256, 1024, 4096), gbits=(1, 10, 25, 100)):
    lines = [f"Allreduce of {size_bytes / 1e6:g} MB, {local_size} ranks per host "
             "(alpha-beta model; milliseconds: ring / hierarchical / torus, fastest)", "",
             "| ranks | network | " + " | ".join(HOSTS) + " |",
             "|---:|---:|" + "---|" * len(HOSTS)]
    tables = {host: simulate(ranks, gbits, size_bytes, local_size, beta)
              for host, beta in HOSTS.items()}
    for i, (P, g, _, _) in enumerate(tables[next(iter(HOSTS))]):
        cells = []
        for host in HOSTS:
            _, _, times, winner = tables[host][i]
            cells.append(f"{times['ring'] * 1e3:.2f} / {times['hierarchical'] * 1e3:.2f} / "
                         f"{times['torus'] * 1e3:.2f}, **{winner}**")
        lines.append(f"| {P} | {g} Gbit/s | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Negotiation per training step (steady state: every tensor cached), from
# figures measured on this machine (README, Negotiation at scale):
# the streamed protocol had rank 0 parse and decide one cached request per
# rank and tensor, 2.09 us each (tests: Controller.submit of RequestLists of
# 161 cache ids at N = 8), and send N - 1 answers; the cycle protocol posts
# one cycle a step (bench (h): 1.0 at 2, 4 and 8 ranks; 1.175 at 16 ranks on
# two cores), an allreduce of 280 bytes for 161 tensors, and plans the ready
# tensors once (0.074 ms for 161).
REQUEST_COST = 2.09e-6
SEND_COST = 5e-6
CYCLES_PER_STEP = 1.0
CYCLE_BYTES = 280
PLAN_COST = 0.074e-3


def streamed_negotiation(P, tensors, alpha=ALPHA_INTER):
    """Seconds rank 0 needs per step with one request list per rank: serial
    on rank 0, so it grows with P."""
    return 2 * alpha + P * tensors * REQUEST_COST + (P - 1) * SEND_COST


def cycle_negotiation(P, tensors, alpha=ALPHA_INTER, beta=25 * GBIT):
    """Seconds per step with negotiation cycles: recursive-doubling
    allreduces of a small vector, log2(P) rounds each; the same on every
    rank, none of it grows with P beyond the log."""
    rounds = math.ceil(math.log2(P)) if P > 1 else 0
    per_cycle = rounds * (alpha + CYCLE_BYTES / beta)
    return CYCLES_PER_STEP * per_cycle + PLAN_COST * tensors / 161


def negotiation_markdown(tensors=161, ranks=(2, 64, 1024, 4096), gbits=(10, 100)):
    lines = [f"Negotiation per step of {tensors} cached tensors (ResNet-50), ms: "
             "one request list per rank / negotiation cycles", "",
             "| ranks | " + " | ".join(f"{g} Gbit/s" for g in gbits) + " |",
             "|---:|" + "---|" * len(gbits)]
    for P in ranks:
        cells = [f"{streamed_negotiation(P, tensors) * 1e3:.2f} / "
                 f"{cycle_negotiation(P, tensors, beta=g * GBIT) * 1e3:.3f}" for g in gbits]
        lines.append(f"| {P} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=100.0,
                        help="allreduce size in MB (ResNet-50's gradients: ~100)")
    parser.add_argument("--local-size", type=int, default=8, help="ranks per host")
    args = parser.parse_args(argv)
    for size in (args.size_mb * 1e6, 1e6 / 16):
        print(markdown(size, args.local_size))
        print()
    print(negotiation_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
