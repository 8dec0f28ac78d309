"""An elastic PyTorch job (Horovod's elastic MNIST example, shrunk): a small
MLP on synthetic data with an ElasticSampler, committed every COMMIT
batches. Prints one line per step ("step <n> size <s> t=<time>") and, at
the end, a checksum of the weights on every rank.

Knobs (environment): EPOCHS, BATCHES (per epoch at 3 ranks), COMMIT, STEP_SLEEP;
KILL_AT=<global step>:<rank> SIGKILLs that rank of the first membership.
"""

import os
import signal
import time

import torch
import torch.nn.functional as F

import frontends.torch as hvd

EPOCHS = int(os.environ.get("EPOCHS", "3"))
BATCHES = int(os.environ.get("BATCHES", "20"))
BATCH_SIZE = 16
COMMIT = int(os.environ.get("COMMIT", "4"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
KILL_AT = os.environ.get("KILL_AT", "")

hvd.init()
torch.manual_seed(0)
data = torch.randn(BATCHES * BATCH_SIZE * 3, 10)
target = (data.sum(dim=1, keepdim=True) > 0).float()
dataset = torch.utils.data.TensorDataset(data, target)
model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
base_lr = 0.05
optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                               epoch=0, batch=0, steps=0)


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = base_lr * hvd.size()
    print(f"reset: rank {hvd.rank()} of {hvd.size()} at epoch {state.epoch} batch "
          f"{state.batch} t={time.time():.3f}", flush=True)


state.register_reset_callbacks([on_reset])


def maybe_die(state):
    if not KILL_AT:
        return
    step, victim = map(int, KILL_AT.split(":"))
    from coordinator.elastic import membership
    if state.steps == step and hvd.rank() == victim and membership.current().generation == 0:
        print(f"killing rank {victim} at step {step} t={time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE,
                                             sampler=state.sampler)
        for idx, (x, y) in enumerate(loader):
            maybe_die(state)
            optimizer.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            optimizer.step()
            state.steps += 1
            state.batch += 1
            state.sampler.record_batch(idx, BATCH_SIZE)
            print(f"step {state.steps} size {hvd.size()} rank {hvd.rank()} "
                  f"loss {loss.item():.4f} t={time.time():.3f}", flush=True)
            time.sleep(STEP_SLEEP)
            if state.batch % COMMIT == 0:
                state.commit()
        state.batch = 0
        state.sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
print(f"final rank {hvd.rank()} size {hvd.size()} steps {state.steps} "
      f"checksum {weights.double().sum().item():.12e} {weights.abs().double().sum().item():.12e}",
      flush=True)
