"""How much of each source a run trains on: fixed weights, or online data mixing.

`mode: static` samples sources with the configured weights. `mode: online` is an EXP3-style bandit
over the sources: sampling probabilities p = (1 - gamma) * w / sum(w) + gamma / K, and every
`update_every` steps each source that was trained on gets the importance-weighted reward r / p
(log w += eta * r / p). The reward is measured on the microbatches the model already trains on (the
objectives report per-source loss sums, `chattune.objectives.source_figures`): `mean_loss`, the mean
training loss of the source's loss units since the last update (where the model still errs), or
`loss_decrease`, how much that mean fell since the previous update (where it still learns).

Every rank adds its own sums and its sampler's position to ONE all-reduce per update, so every rank
computes the same new probabilities and applies them from the same draw: the furthest draw any rank
has generated (its loader may have prefetched records under the old probabilities; those stay as they
were drawn). The weights, the schedule of probabilities and the reward accumulators are checkpointed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from chattune.config.schema import MIXING_MODES, MIXING_REWARDS, MixingConfig
from chattune.data.ingest.formats import SourceSpec
from chattune.data.ingest.source_mixture import MixtureSampler, ProbabilitySchedule
from chattune.distributed import all_reduce_sum, world_rank, world_size


class Mixer:
    def __init__(
        self,
        names: Sequence[str],
        weights: Sequence[float],
        mode: str,
        gamma: float = 0.1,
        eta: float = 0.1,
        update_every: int = 10,
        reward: str = "mean_loss",
    ):
        if mode not in ("static", "online"):
            raise ValueError(f"data.mixing.mode must be static or online for a mixer, got {mode!r}")
        if reward not in MIXING_REWARDS:
            raise ValueError(f"data.mixing.reward must be one of {MIXING_REWARDS}, got {reward!r}")
        if not 0.0 <= gamma <= 1.0 or eta < 0 or update_every < 1:
            raise ValueError(
                f"data.mixing needs 0 <= gamma <= 1, eta >= 0, update_every >= 1; got {gamma}, {eta}, {update_every}"
            )
        weights = np.asarray(weights, dtype=np.float64)
        if len(weights) < 2 or (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(
                f"a mixture needs at least two sources and non-negative weights with a positive sum, got {weights.tolist()}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"the sources of a mixture need distinct names (set `name:` on each), got {list(names)}")
        self.names, self.mode, self.gamma, self.eta = list(names), mode, gamma, eta
        self.update_every, self.reward = update_every, reward
        self.target = weights / weights.sum()  # the configured proportions
        with np.errstate(divide="ignore"):
            self.log_weights = np.log(self.target)  # online: the configured weights are the prior
        self.schedule = ProbabilitySchedule(self.probabilities())
        self.interval = np.zeros((2, len(names)))  # this rank's loss sums and loss units since the last update
        self.totals = np.zeros((2, len(names)))  # this rank's documents and trainable tokens since the start
        self.previous_mean = np.full(len(names), np.nan)  # loss_decrease: each source's mean at the last update
        self.sampler: MixtureSampler | None = None

    @property
    def num_sources(self) -> int:
        return len(self.names)

    def probabilities(self) -> np.ndarray:
        if self.mode == "static":
            return self.target
        weights = np.exp(self.log_weights - self.log_weights.max())
        return (1.0 - self.gamma) * weights / weights.sum() + self.gamma / self.num_sources

    def observe(self, figures: dict[str, float], finite: bool) -> None:
        """This rank's per-source sums of one step (`source_figures`); a non-finite step's losses are
        left out of the rewards (the update was skipped), its documents still count as seen."""
        for k in range(self.num_sources):
            self.totals[:, k] += figures[f"source_documents/{k}"], figures[f"source_tokens/{k}"]
            if finite:
                self.interval[:, k] += figures[f"source_loss/{k}"], figures[f"source_units/{k}"]

    def maybe_update(self, step: int, device: torch.device) -> dict[str, float] | None:
        """Collective on update steps (online mode, every `update_every` steps): the new probabilities,
        identical on every rank, and their log figures; None on other steps."""
        if self.mode != "online" or step % self.update_every:
            return None
        world, rank = world_size(), world_rank()
        positions = np.zeros(world)
        positions[rank] = self.sampler.draw
        sums = (
            all_reduce_sum(
                torch.tensor(np.concatenate([self.interval.ravel(), positions]), dtype=torch.float64, device=device)
            )
            .cpu()
            .numpy()
        )
        loss, units = sums[: 2 * self.num_sources].reshape(2, self.num_sources)
        seen = units > 0
        mean = np.where(seen, loss / np.maximum(units, 1e-12), np.nan)
        if self.reward == "mean_loss":
            reward = np.where(seen, mean, 0.0)
        else:
            reward = np.where(seen & ~np.isnan(self.previous_mean), self.previous_mean - mean, 0.0)
            self.previous_mean = np.where(seen, mean, self.previous_mean)
        in_force = self.schedule.latest()
        self.log_weights = self.log_weights + self.eta * np.where(seen, reward / in_force, 0.0)
        probabilities = self.probabilities()
        self.schedule.add(int(sums[2 * self.num_sources :].max()), probabilities)
        self.interval[:] = 0.0
        figures = {}
        for k, name in enumerate(self.names):
            figures[f"mix/{name}/reward"] = float(reward[k])
            figures[f"mix/{name}/log_weight"] = float(self.log_weights[k])
            figures[f"mix/{name}/probability"] = float(probabilities[k])
        return figures

    def metrics(self, device: torch.device) -> dict[str, float]:
        """Collective: documents and trainable tokens of each source so far (all ranks), and the share
        of documents each source had against its target (the configured weight, or online the current
        probability)."""
        totals = all_reduce_sum(torch.tensor(self.totals, dtype=torch.float64, device=device)).cpu().numpy()
        documents = max(totals[0].sum(), 1.0)
        target = self.probabilities()
        out = {}
        for k, name in enumerate(self.names):
            out[f"mix/{name}/documents"] = int(totals[0, k])
            out[f"mix/{name}/trainable_tokens"] = int(totals[1, k])
            out[f"mix/{name}/share"] = float(totals[0, k] / documents)
            out[f"mix/{name}/target"] = float(target[k])
        return out

    def state_dict(self) -> dict:
        return {
            "log_weights": self.log_weights.tolist(),
            "schedule": self.schedule.state_dict(),
            "interval": self.interval.tolist(),
            "totals": self.totals.tolist(),
            "previous_mean": self.previous_mean.tolist(),
        }

    @staticmethod
    def merge_states(states: list[dict], rank: int) -> dict:
        """A state saved by `len(states)` ranks, for rank `rank` of another number of ranks: the weights and
        the schedule are the same on every rank; the loss and document sums, which are only ever all-reduced,
        are put whole on rank 0 (zeros elsewhere), so their totals are unchanged."""
        merged = dict(states[0])
        for name in ("interval", "totals"):
            total = sum(np.asarray(state[name]) for state in states)
            merged[name] = (total if rank == 0 else np.zeros_like(total)).tolist()
        return merged

    def load_state_dict(self, state: dict) -> None:
        self.log_weights = np.asarray(state["log_weights"])
        self.schedule.load_state_dict(state["schedule"])
        self.interval = np.asarray(state["interval"])
        self.totals = np.asarray(state["totals"])
        self.previous_mean = np.asarray(state["previous_mean"])


def mixture_sampling(
    mixing: MixingConfig,
    specs: Sequence[SourceSpec],
    sizes: Sequence[int],
    share: int,
    num_shares: int,
    seed: int,
    num_epochs: int | None,
    chunk_records: int,
) -> tuple[Mixer | None, MixtureSampler | None]:
    """The mixer and the sampler of share `share` of `num_shares` (this rank's, or the whole mixture for
    world-size-invariant steps) for `data.mixing`; both None for mode `none` (the sources are simply
    concatenated and every record is seen once per epoch)."""
    if mixing.mode not in MIXING_MODES:
        raise ValueError(f"data.mixing.mode must be one of {MIXING_MODES}, got {mixing.mode!r}")
    if mixing.mode == "none":
        return None, None
    mixer = Mixer(
        [spec.display_name for spec in specs],
        [spec.weight for spec in specs],
        mixing.mode,
        mixing.gamma,
        mixing.eta,
        mixing.update_every,
        mixing.reward,
    )
    mixer.sampler = MixtureSampler(
        sizes, mixer.schedule, share, num_shares, seed, mixing.stopping, num_epochs, chunk_records
    )
    return mixer, mixer.sampler
