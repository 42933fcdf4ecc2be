"""One training run, for every backend and every model and data kind (objective.py is what differs).

`Trainer(cfg, ...)` does every check that can fail before any process group; `run()` joins the process group,
sets up (resume decision, data, model, wrap, checkpoint load), trains, and always tears down. `train()` is the loop:
it asks `train_step` for a step and the others when to log, evaluate and checkpoint, as torchtitan's trainer does.
"""

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from distsetup.errors import DistsetupError
from distsetup.formats.batch import global_batch_of
from distsetup.formats.checkpoint_folder import Marker
from distsetup.formats.runconfig import RunConfig, names_user_code
from distsetup.training import memory, resuming, run_record, user_code
from distsetup.training.backends import make_backend
from distsetup.training.checkpoint import universal_folder
from distsetup.training.checkpoint.run_checkpoints import RunCheckpoints
from distsetup.training.data.datasets import Datasets, ShardedSampler, build_datasets
from distsetup.training.data.evaluation import evaluate
from distsetup.training.data.loader import StepLoader
from distsetup.training.evaluations import Evaluations
from distsetup.training.host_allocator import hand_back_freed_heap, map_large_tensors_apart, mapped_apart_from
from distsetup.training.launch_env import read_world, run_identity
from distsetup.training.loop import Loop
from distsetup.training.loss.micro_loss import MicroLoss, mean_terms
from distsetup.training.loss.objective import objective_for
from distsetup.training.loss.python_objective import PythonObjective
from distsetup.training.loss.token_objective import TokenObjective
from distsetup.training.metrics import MetricsLog, StepTimer, as_json, reporters, wandb_settings
from distsetup.training.model import build as models
from distsetup.training.model import pretrained
from distsetup.training.model.blocks import recompute_mismatch
from distsetup.training.model.throughput import device_peak_tflops, mfu
from distsetup.training.model_setup import check_model_fits, flops_per_item, largest_activation_bytes, whole_model
from distsetup.training.preemption import Preemption
from distsetup.training.progress import Progress
from distsetup.training.run_length import run_steps, step_cap
from distsetup.training.run_lock import OutputDirLock
from distsetup.training.run_record import METRICS, SUMMARY
from distsetup.training.world import (
    StepAgreement,
    barrier,
    decided_by_rank0,
    destroy_process_group,
    init_process_group,
    is_lost_contact,
    lost_contact,
    pick_device,
    synchronizer,
)


class Trainer:
    def __init__(self, cfg: RunConfig, *, config_folder: Path | None, no_resume: bool, init_from: str | None):
        """Every check that can fail before a process group: the backend and its file, the device's precision, the
        model (its builder, blocks and size: counted for the built-in GPT, else from a copy built on the meta
        device), the node's memory against it, the user's loss and data functions, the reporters; then this run
        takes its output folder's lock. `config_folder`: the run config's (the user's modules are there);
        `no_resume`, `init_from`: the command line's --no_resume and --init_from."""
        self.cfg, self.t = cfg, cfg.training
        self.no_resume, self.init_from = no_resume, init_from
        self.step_cap = step_cap()
        self.world = world = read_world()
        self.say = print if world.is_main else (lambda *a, **k: None)
        self.device = pick_device(world)
        self.backend = backend = make_backend(cfg.distributed.backend, cfg, world, self.device)
        backend.check_device_support()
        backend.set_up_device()
        self.global_batch = global_batch_of(backend.micro_batch, backend.accumulation, world.size)
        # the user's modules come from the run config's folder, else the working folder
        self.user_code = user_code.make_importable(config_folder) if names_user_code(cfg) else None
        self.model_description = models.describe(cfg.model)
        backend.check_model(self.model_description)
        if cfg.model.builder:  # where model.builder was found, for `distsetup checkpoint convert`
            self.user_code = user_code.found_in(cfg.model.builder) or self.user_code
        check_model_fits(cfg.model, self.model_description, backend, world, self.device)
        self.loss_function = user_code.load(self.t.loss, "training.loss") if self.t.loss else None
        # the user's datasets are built now, before any process group (token data: once it exists, by rank 0)
        self.built_data = self._datasets() if cfg.data.type == "python" else None
        self.report_to = reporters(self.t.report_to)
        self.out_dir = Path(self.t.output_dir)
        self.ckpt_root = self.out_dir / run_record.CHECKPOINTS
        self.lock = OutputDirLock(self.out_dir)
        if world.is_main:
            self.lock.acquire()
            if not self.lock.unsupported:  # without a lock another run could be loading one
                universal_folder.remove_stale(self.out_dir)
        self.preemption = Preemption(announce=world.is_main)
        self.step, self.loss = 0, float("nan")
        self.checkpoints = RunCheckpoints(backend, world, self.ckpt_root, self.t.keep_checkpoints, backend.precision)
        self.max_steps = self.t.max_steps  # or the epochs' steps, once the data is known (_build_data)
        self.schedule_steps = self.max_steps  # what the learning-rate schedule spans: the run's, uncapped
        self.setup_peak = 0  # this rank's peak resident bytes in set-up
        self.training_peak = memory.TrainingPeak()
        self.pretrained: pretrained.Pretrained | None = None  # the checkpoint each rank reads its part of
        self.model_section = dataclasses.asdict(cfg.model)  # checked against a checkpoint's, stored in each

    # -- the run ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Join the process group, set up, train; the process group and the lock go whatever happens."""
        status = 1  # what the run exits with
        loop: Loop | None = None
        if self.backend.needs_process_group:
            timeout = self.cfg.distributed.timeout_minutes
            init_process_group(self.world, self.device, timeout, self.backend.needs_cpu_collectives())
        try:
            loop = self._set_up()
            status = self.train(loop)
            return status
        except BaseException as e:  # DCP's CheckpointException is no Exception
            if is_lost_contact(e):  # a collective failed or timed out: another rank is gone
                hint = self.backend.hang_hint(bool(self.model_description.conditional))
                raise lost_contact(e, self.world, self.step, self.cfg.distributed.timeout_minutes, hint)
            raise
        finally:
            try:
                if loop is not None:
                    loop.close(status)
            finally:
                destroy_process_group()
                self.lock.release()

    def train(self, loop: Loop) -> int:
        """The loop: steps until training.max_steps, logging, evaluating and checkpointing when due; PREEMPTED (or
        INTERRUPTED, for a Ctrl-C) once the ranks have agreed to stop and checkpointed."""
        t = self.t
        with self.preemption.ctrl_c_checkpoints():
            # resumed at a step whose evaluation a stop left out: it runs first (stopped again during it, the
            # checkpoint this run resumed from is the one to come back to)
            if loop.evaluations.resumed_step_left_out(self.step) and not self._left_out_evaluated(loop):
                return self.preemption.stopped_at(self.step, self.say)
            while self.step < self.max_steps:
                lr = self.backend.current_lr()
                micro_losses, loss_scale = self.train_step(loop)
                log_now, checkpoint_now = self._logs_at(self.step), self._checkpoints_at(self.step)
                evaluating = loop.evaluations.due_at(self.step)
                # the step after a checkpoint trained from its weights: its loss confirms or withdraws it
                confirming = self.checkpoints.unconfirmed is not None
                # an evaluation's step too: a stop during it checkpoints and logs this step's loss
                terms, stop = self._agree(loop, micro_losses, log_now or checkpoint_now or confirming or evaluating)
                if confirming:
                    self.checkpoints.confirm_or_withdraw(self.step, self.loss)
                if terms is not None and (log_now or stop):
                    self._log(loop, terms, lr, loss_scale)
                if stop and self.step == self.max_steps:  # the training is done: its checkpoint comes first
                    self._checkpoint(loop, background=False, confirmed=True)
                    if self._last_evaluation_left_out(loop):  # within the grace period: left to the run started again
                        self.say(
                            f"note: asked to stop at the last step, {self.step}: its training is done, its evaluation "
                            "runs when the run is started again"
                        )
                        return self.preemption.stopped_at(self.step, self.say)
                    self.say(f"note: asked to stop at the last step, {self.step}: the run finishes")
                    break
                if evaluating and not stop and not self._evaluated(loop):  # the ranks agreed to stop during it
                    stop = True
                    if terms is not None and not log_now:
                        self._log(loop, terms, lr, loss_scale)
                if stop or checkpoint_now:
                    # a stopped run's is whole, and the run that resumes from it confirms it at its first step; the
                    # last one no step confirms: it is trusted, as the finished run's result
                    last = self.step == self.max_steps
                    self._checkpoint(loop, background=t.async_checkpoint and not stop, confirmed=last)
                if stop:
                    return self.preemption.stopped_at(self.step, self.say)
        if self.checkpoints.pending is not None:
            with self.training_peak.left_out(self.step), loop.timer.checkpointing():
                self.checkpoints.finish_pending()
        if self._last_evaluation_left_out(loop) and not self._left_out_evaluated(loop):  # stopped: checkpoint written
            return self.preemption.stopped_at(self.step, self.say)
        loop.progress.close()
        self._summarize(loop, self._host_peaks())
        return 0

    def train_step(self, loop: Loop) -> tuple[list[MicroLoss], float | None]:
        """One optimizer step: its micro-batches' losses (on the device) and the fp16 loss scale its backward used
        (read only for a step that logs: on a GPU, reading it waits for the device)."""
        batches = loop.loader.next_step()
        weights = loop.objective.step_weights(batches, self.world.size, self.device)
        micro_losses = self.forward_backward(loop, batches, weights)
        loss_scale = self.backend.current_loss_scale() if self._logs_at(self.step + 1) else None
        self.backend.step()
        self.step += 1
        loop.timer.step_done()
        loop.progress.step_done()
        return micro_losses, loss_scale

    def forward_backward(self, loop: Loop, batches: list, weights: Sequence[float | torch.Tensor]) -> list[MicroLoss]:
        """Forward and backward each micro-batch; the backend synchronises gradients on the last one."""
        last = len(batches) - 1
        try:
            return [
                self.backend.backward(
                    functools.partial(loop.objective.micro_loss, batch=batch, weight=weight), m == last
                )
                for m, (batch, weight) in enumerate(zip(batches, weights, strict=True))
            ]
        except RuntimeError as e:
            if (said := recompute_mismatch(e)) is not None:
                raise said from e
            raise

    # -- set-up, after the process group ----------------------------------------------------------------------
    def _set_up(self) -> Loop:
        """The checkpoint to resume (decided by rank 0), the data, the model wrapped by the backend, the state
        loaded, and what the loop keeps (metrics, progress, loader, timer)."""
        self.backend.fit_to_the_model(self.model_description.parameters)
        resume = self._resume_decision()
        self._say_backend()
        self._say_init_from(resume)
        self._set_aside_previous_run(resume)
        data, sampler = self._build_data(resume)
        objective, flops, peak = self._build_model(data)
        evaluated_at = self._load(resume, sampler) if resume else None
        if resume and isinstance(objective, PythonObjective):  # its first-step check names the checkpoint
            objective.resumed_from = resume
        self.out_dir.mkdir(parents=True, exist_ok=True)
        metrics = self._metrics_log(resumed=resume is not None)
        if metrics.repeated_lines:  # a crashed run's, past its last checkpoint
            self.say(f"note: {METRICS} goes on from step {self.step}: removed {metrics.repeated_lines} later line(s)")
        progress = Progress(self.max_steps, self.step, shown=self.world.is_main)
        try:  # what the Loop closes, closed here until there is one
            timer, agreement = StepTimer(synchronizer(self.device)), StepAgreement(self.world.size, self.device)
            workers, placement = self.cfg.data.num_workers, self.backend.placement
            loader = StepLoader(data.train, sampler, data.collate, workers, placement, data.collating)
        except BaseException:
            progress.close()
            metrics.close(1)
            raise
        evaluations = Evaluations(data.val is not None, self.t.eval_interval, self.max_steps, evaluated_at)
        if self.world.is_main:  # a resumed run's summary lists the evaluations before it too
            evaluations.records = run_record.evaluations(self.out_dir / METRICS)
        loop = Loop(
            data, sampler, objective, flops, peak, metrics, progress, loader, timer, agreement, evaluations, self.step
        )
        if self.device.type == "cuda":  # summary.json's peak_device_bytes: the training's peak, not the set-up's
            torch.cuda.reset_peak_memory_stats(self.device)
        self.setup_peak = memory.host_peak_bytes()
        memory.reset_host_peak()  # the training's peak from here on, not the set-up's
        return loop

    def _metrics_log(self, resumed: bool) -> MetricsLog:
        """Rank 0's metrics files and reporters, opened while the other ranks wait for its answer: where W&B refuses
        to start (no login), every rank says W&B's line once instead of losing contact with rank 0."""
        wandb = wandb_settings(self.cfg, resumed, self.max_steps)
        opened: list[MetricsLog] = []
        decided_by_rank0(lambda: opened.append(MetricsLog(self.out_dir, True, self.report_to, wandb, self.step)))
        return opened[0] if opened else MetricsLog(self.out_dir, False, self.report_to, wandb, self.step)

    def _resume_decision(self) -> Path | None:
        self.no_resume = resuming.afresh(self.no_resume, self.out_dir, self.say)
        resume = resuming.resume_decision(self.ckpt_root, self.no_resume, self.backend, self.model_section, self.say)
        if self.lock.unsupported:
            self.say(f"note: {self.lock.unsupported}")
        return resume

    def _say_backend(self) -> None:
        backend = self.backend
        for note in self.cfg.notes:  # how the run config was read: other tools' names, inline FSDP settings
            self.say(f"note: {note}")
        self.say(backend.line())
        if backend.lr_scaled:
            self.say(f"lr scaled ({self.t.scale_lr}) to {backend.lr:.6g} for global batch {self.global_batch}")
        for note in self.model_description.notes:
            self.say(f"note: {note}")

    def _say_init_from(self, resume: Path | None) -> None:
        """Where the weights come from, said as a resume says it: --init_from's, or a resumed checkpoint's over them
        (the file is still read: under FSDP2 and ZeRO-3 each rank's part of it is its cheapest start)."""
        if not self.init_from:
            return
        if resume:
            self.say(
                f"note: the run resumes from its own checkpoint, whose weights replace --init_from {self.init_from}"
            )
        else:
            self.say(f"weights from {self.init_from}; the optimizer and the schedule start at step 0")

    def _set_aside_previous_run(self, resume: Path | None) -> None:
        """A run that starts afresh sets the previous run's record aside, so that a plot does not mix the two: with
        --no_resume all of it (else a later resume would pick a stale step), noting which run did, for its restarts;
        where no checkpoint was there to resume (a crash before the first, the checkpoints removed or passed over as
        damaged), its metrics and summary."""
        if resume is None and self.world.is_main:
            names = run_record.RECORD if self.no_resume else run_record.METRICS_AND_SUMMARY
            if aside := run_record.set_aside(self.out_dir, names):
                why = "--no_resume" if self.no_resume else "note: no checkpoint to resume"
                self.say(f"{why}: moved the previous run's record to {aside}")
            if self.no_resume:
                run_record.note_fresh_start(self.out_dir, run_identity())
        barrier()

    def _datasets(self) -> Datasets:
        try:
            return build_datasets(self.cfg, ranks=self.world.size)
        except DistsetupError as e:  # the same files and settings on every rank
            e.alike_on_every_rank = True
            raise

    def _build_data(self, resume: Path | None) -> tuple[Datasets, ShardedSampler]:
        """The datasets (rank 0 tokenizes text into the cache while the others wait) and the order ranks read; the
        run's steps (training.epochs counted from checkpoint `resume`'s data position)."""
        backend, world, t = self.backend, self.world, self.t
        data = self.built_data or self._datasets()
        for note in data.notes:
            self.say(note)
        sampler = ShardedSampler(
            len(data.train), backend.micro_batch, backend.accumulation, world.size, world.rank, t.seed
        )
        resumed = None
        if t.epochs is not None and resume is not None:
            marker = Marker.read(resume)
            if marker.data_position is not None:  # as resuming.load loads it, for the steps left in the epochs
                sampler.load_state_dict(marker.data_position)
                resumed = (marker.step, sampler.steps_until_end_of_epoch(t.epochs))
        # before wrap(): the learning-rate schedule spans the whole run
        per_epoch = len(data.train) // self.global_batch
        self.max_steps, said = run_steps(t.max_steps, t.epochs, per_epoch, self.step_cap, resumed)
        # a run capped for a smoke test trains the whole run's first steps, on its schedule
        self.schedule_steps = run_steps(t.max_steps, t.epochs, per_epoch, None, resumed)[0]
        for line in said:
            self.say(line)
        return data, sampler

    def _build_model(self, data: Datasets) -> tuple[TokenObjective | PythonObjective, float | None, float | None]:
        """The model (rank 0's values with the run's seed, in every rank's part) wrapped by the backend; its objective,
        its training FLOPs per item and the device's peak (for MFU)."""
        m, t, backend = self.cfg.model, self.t, self.backend
        torch.manual_seed(t.seed)
        whole, self.pretrained = whole_model(m, self.init_from, self.model_description, backend, self.world, self.say)
        build = functools.partial(models.build_to_be_filled, m)
        # ZeRO-3: every rank constructs its partitions of the model (deepspeed.zero.Init), rank 0's values put in
        partitioned = backend.partitions_at_construction and self.model_description.builds_on_meta
        module = backend.construct(build, whole, self.pretrained) if partitioned else whole
        parts = models.parts(module, m, self.model_description.layer_classes)
        parts.pretrained = self.pretrained
        # the head check runs a forward on rank 0: on its whole model, or where it has none (a skeleton) on a copy
        probe = pretrained.runnable_copy(whole) if self.pretrained and self.world.is_main else whole
        objective, note = objective_for(module, self.cfg, data, self.loss_function, probe=probe)
        objective.weights_cast = backend.weights_cast_without_autocast  # said where a forward mixes dtypes
        if isinstance(objective, TokenObjective):  # a term the model returned that the loss leaves out
            objective.say = self.say
        del probe
        if note:
            self.say(f"note: {note}")
        peak = t.peak_tflops or device_peak_tflops(self.device, backend.precision)
        # the whole model, before sharding
        flops = flops_per_item(m, whole, data, backend.micro_batch, peak, objective.unchecked_loss, self.say)
        del whole  # rank 0's values are in every rank's part (ZeRO-3), or wrap() takes them
        backend.wrap(parts, self.schedule_steps)
        if backend.gathers_weights:  # set up mapping 2 MiB apart (train.py); the step's activations kept in the heap
            tokens = backend.micro_batch * m.block_size if data.tokens else 0
            map_large_tensors_apart(mapped_apart_from(largest_activation_bytes(module, tokens)))
        if self.device.type == "cpu":  # what set-up freed (rank 0's whole copy, ZeRO-3's partitions made flat)
            hand_back_freed_heap()
        if self.pretrained:  # every rank has read its part
            self.pretrained.close()
        for note in backend.notes:  # after wrap(): it adds notes of its own
            self.say(f"note: {note}")
        torch.manual_seed(t.seed + self.world.rank)  # dropout differs per rank
        return objective, flops, peak

    def _load(self, resume: Path, sampler: ShardedSampler) -> int | None:
        """The checkpoint's state loaded; the step of its evaluation, where it has one."""
        marker = resuming.load(
            resume,
            self.backend,
            self.world,
            sampler,
            self.global_batch,
            self.schedule_steps,
            self.model_section,
            self.say,
        )
        self.step, self.loss = marker.step, self.loss if marker.loss is None else marker.loss
        self.checkpoints.resumed_from(resume, marker)
        return marker.step if marker.val_loss is not None else None

    # -- what the loop asks -----------------------------------------------------------------------------------
    def _logs_at(self, step: int) -> bool:
        return step % self.t.log_interval == 0 or step == self.max_steps

    def _checkpoints_at(self, step: int) -> bool:
        return step % self.t.checkpoint_interval == 0 or step == self.max_steps

    def _last_evaluation_left_out(self, loop: Loop) -> bool:
        return loop.evaluations.last_step_left_out(self.step, loop.first_step, self.out_dir / SUMMARY)

    def _agree(self, loop: Loop, micro_losses: list[MicroLoss], must: bool) -> tuple[dict[str, float] | None, bool]:
        """On steps the ranks must agree on (logs, checkpoints) and about once a second: the step's loss terms over
        ranks, and whether to stop (a signal reached a rank). A background checkpoint every rank has written
        completes here, at the same step on every rank."""
        if not (must or loop.agreement.due(self.step)):
            return None, False
        step_seconds = loop.timer.median_step_seconds or 0.0  # train_step() recorded a step: never 0
        terms, stop, written = loop.agreement.agree(
            self.step, mean_terms(micro_losses), self.preemption.requested, step_seconds, self.checkpoints.writing()
        )
        self.loss = terms["loss"]
        if written:  # every rank's part of the checkpoint written in the background is on disk
            self.checkpoints.finish_pending()
        return terms, stop

    def _log(self, loop: Loop, terms: dict[str, float], lr: float, loss_scale: float | None) -> None:
        steps, seconds = self.step - loop.logged[0], loop.timer.train_seconds - loop.logged[1]
        per_s = steps * self._items_per_step(loop) / max(seconds, 1e-9)
        loop.logged = (self.step, loop.timer.train_seconds)
        throughput = {f"{loop.objective.unit}_per_s": per_s}
        mfu_now = mfu(per_s, loop.flops, self.world.size, loop.peak) if loop.flops else None
        loop.metrics.write(self.step, **terms, lr=lr, **throughput, mfu=mfu_now, loss_scale=loss_scale)
        loop.progress.logged(self.step, self.loss, lr, per_s, loop.objective.unit, mfu_now, loss_scale)

    def _items_per_step(self, loop: Loop) -> int:
        """What throughput counts in one step: tokens (token data) or samples."""
        return self.global_batch * (self.cfg.model.block_size if loop.objective.unit == "tokens" else 1)

    def _left_out_evaluated(self, loop: Loop) -> bool:
        """_evaluated, for the evaluation a stop left out after its step's checkpoint: its loss into that marker."""
        if not self._evaluated(loop):
            return False
        self.checkpoints.add_evaluation(self.step, loop.evaluations.val_loss_at(self.step))
        return True

    def _evaluated(self, loop: Loop) -> bool:
        """Whether the step's evaluation ran to its end (else the ranks agreed to stop during it)."""
        workers = self.cfg.data.num_workers
        evaluate_now = functools.partial(
            evaluate, self.backend, loop.objective, loop.data, self.world, workers, lambda: self.preemption.requested
        )
        with loop.timer.evaluating():
            return loop.evaluations.run(self.step, evaluate_now, loop.metrics, loop.progress)

    def _checkpoint(self, loop: Loop, background: bool, confirmed: bool) -> None:
        marker = Marker(
            backend=self.backend.name,
            step=self.step,
            world_size=self.world.size,
            zero_stage=self.backend.zero_stage,
            precision=self.backend.precision,
            model=self.model_section,  # what `distsetup checkpoint export` writes beside the weights
            user_code=str(self.user_code) if self.user_code else None,
            loss=self.loss,
            val_loss=loop.evaluations.val_loss_at(self.step),
            sampler=loop.sampler.state_dict(),
            confirmed=None if confirmed else False,
        )
        with self.training_peak.left_out(self.step), loop.timer.checkpointing():
            self.checkpoints.write(marker, background, confirmed)

    def _host_peaks(self) -> dict[str, list[int]]:
        """Each rank's peak resident memory after set-up and in training (checkpoints left out), and the bytes of
        pretrained weights it read: a collective."""
        self.training_peak.note(self.step)
        read = self.pretrained.bytes_read if self.pretrained else 0
        return memory.every_ranks(
            {"setup": self.setup_peak, "training": self.training_peak.bytes, "read": read}, self.world.size
        )

    def _summarize(self, loop: Loop, host_peaks: dict[str, list[int]]) -> None:
        """Rank 0's summary.json, and the last line."""
        if not self.world.is_main:
            return
        summary_file = self.out_dir / SUMMARY
        if self.step == loop.first_step and summary_file.is_file():  # started where the run ended: the run's figures
            self.say(f"done: the run is at step {self.step} of {self.max_steps} already; {summary_file} is its summary")
            return
        summary = {
            "steps": self.step,
            "final_loss": self.loss,
            "world_size": self.world.size,
            **loop.figures(self.step, self.world.size, self._items_per_step(loop)),
            **self.backend.summary(),
            # per rank: resident memory's high-water mark after set-up, in training
            "host_peak_bytes": {"setup": host_peaks["setup"], "training": host_peaks["training"]},
        }
        if self.pretrained:  # per rank: what it read of the checkpoint it started from
            summary["pretrained_read_bytes"] = host_peaks["read"]
        # valid JSON: null for a loss there is none of (no step ran, none in the checkpoint) or that diverged
        summary_file.write_text(as_json(summary, indent=2))
        loop.metrics.summarize(summary)
        unit, per_s = loop.objective.unit, summary[f"{loop.objective.unit}_per_s"]
        pace = "" if per_s is None else f", {per_s:.0f} {unit}/s"
        self.say(f"done: {self.step} steps, final loss {self.loss:.4f}{pace}; summary in {summary_file}")
