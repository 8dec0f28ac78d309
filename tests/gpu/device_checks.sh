#!/bin/bash
# Issue 13's GPU checks in one run on the GPU machine, sized to fit one call
# of its device tool (at most 10 minutes a command, 15 minutes a session,
# start-up included). From a checkout there that carries .device and
# coordinator/_wire (make gpu-prepare readies .device here):
#
#     bash tests/gpu/device_checks.sh [tests] [bench] [r18] [r50]
#
# With no argument it runs all four, in that order, in at most 8.5 minutes
# (the four limits, 510 s, plus installing the carried wheels):
#   tests  the GPU tests at np=2 (make test-gpu)
#   bench  python -m coordinator.bench --gpu: (A) 64 MiB, (B) ResNet-50's 161
#          gradients, against bare cupy.cuda.nccl
#   r18    examples/torch/compare_ddp.py, ResNet-18 step against DDP (NCCL)
#   r50    the same with ResNet-50
#   p18    ResNet-18 again, 3 steps of each implementation under torch.profiler:
#          per step, its NCCL calls on the device clock, when backward's
#          kernels ended, the tail after them (compare_ddp.py --profile; the
#          traces stay in /tmp/p18 there: the device tool returns at most 8
#          files). Not in the default set: name it.
#   p50    the same with ResNet-50
#   h18    ResNet-18 again, 3 steps of each with the host's time laid out
#          (compare_ddp.py --host-profile): backward() and opt.step() on the
#          host, what each gradient submission cost, and where every thread
#          was when sampled. Not in the default set: name it.
#   h50    the same with ResNet-50
#   a18    r18 with HOROVOD_ENABLE_ASYNC_COMPLETION=1 (compare_ddp.py
#          --async-completion); not in the default set: name it
#   a50    the same with ResNet-50
#   l18    r18 with ours also run at other hold leads (compare_ddp.py
#          --hold-lead 0,1,4: 'ours' holds gradients for the busy GPU lane
#          until 2 ms before it should be free, 'ours@0' until then, the
#          others 1 and 4 ms before) and with the optimizer's gradients
#          completed on the host, not in stream order ('ours-host',
#          --host-completion), and with an idle lane's ready events
#          recorded at launch, not at submission ('ours-launch',
#          --ready-at-launch), and with the interpreter's switch interval
#          left at Python's 5 ms ('ours~0') or at 50 us ('ours~50') while GPU
#          work is in flight, not 100 us (--switch-interval 0,50), all in one
#          rotation; name it
#   l50    the same with ResNet-50
# Each part has a time limit, so one that hangs leaves time for the rest;
# on 2026-11-27 each took 15-22 s there (the machine's start about 30 s more).
# Its whole output goes to $OUT/<part>.txt (./gpu-out without $OUT), its
# last lines and exit status to stdout.
cd "$(dirname "$0")/../.." || exit 1
for part in "$@"; do
  case $part in tests|bench|r18|r50|p18|p50|h18|h50|a18|a50|l18|l50) ;; *) echo "unknown part '$part' (tests, bench, r18, r50, p18, p50, h18, h50, a18, a50, l18, l50)" >&2; exit 2 ;; esac
done
# Install the carried wheels and build the native kernels once, for all parts.
[ -n "$MPIRUN2" ] || exec bash .device/device_env.sh bash tests/gpu/device_checks.sh "$@"
out=${OUT:-gpu-out}
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench r18 r50)
nvidia-smi -L > "$out/smi.txt" 2>&1
cat "$out/smi.txt"
for part in "${parts[@]}"; do
  case $part in
    tests) limit=140 cmd='$MPIRUN2 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu' keep=6 ;;
    bench) limit=100 cmd='$MPIRUN2 $PY -m coordinator.bench --gpu' keep=8 ;;
    r18) limit=120 cmd='$MPIRUN2 $PY examples/torch/compare_ddp.py --model resnet18 --device cuda --ddp-backend nccl --batch-size 32 --rounds 8' keep=6 ;;
    r50) limit=150 cmd='$MPIRUN2 $PY examples/torch/compare_ddp.py --model resnet50 --device cuda --ddp-backend nccl --batch-size 32 --rounds 6' keep=6 ;;
    a18) limit=120 cmd='$MPIRUN2 $PY examples/torch/compare_ddp.py --model resnet18 --device cuda --ddp-backend nccl --batch-size 32 --rounds 8 --async-completion' keep=6 ;;
    a50) limit=150 cmd='$MPIRUN2 $PY examples/torch/compare_ddp.py --model resnet50 --device cuda --ddp-backend nccl --batch-size 32 --rounds 6 --async-completion' keep=6 ;;
    l18) limit=170 cmd='$MPIRUN2 $PY examples/torch/compare_ddp.py --model resnet18 --device cuda --ddp-backend nccl --batch-size 32 --rounds 8 --hold-lead 0,1,4 --host-completion --ready-at-launch --switch-interval 0,50' keep=13 ;;
    l50) limit=230 cmd='$MPIRUN2 $PY examples/torch/compare_ddp.py --model resnet50 --device cuda --ddp-backend nccl --batch-size 32 --rounds 6 --hold-lead 0,1,4 --host-completion --ready-at-launch --switch-interval 0,50' keep=13 ;;
    p18|p50) limit=120 model=resnet${part#p}
      cmd="\$MPIRUN2 \$PY examples/torch/compare_ddp.py --model $model --device cuda --ddp-backend nccl --batch-size 32 --rounds 2 --profile 3 --profile-dir /tmp/$part" keep=40 ;;
    h18|h50) limit=90 model=resnet${part#h}
      cmd="\$MPIRUN2 \$PY examples/torch/compare_ddp.py --model $model --device cuda --ddp-backend nccl --batch-size 32 --rounds 2 --host-profile 3" keep=50 ;;
  esac
  echo "== $part (limit ${limit} s): $cmd"
  start=$SECONDS
  timeout -k 10 "$limit" bash -c "$cmd" > "$out/$part.txt" 2>&1
  rc=$?
  tail -n "$keep" "$out/$part.txt"
  echo "== $part: exit $rc after $((SECONDS - start)) s"
done
