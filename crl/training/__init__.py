"""The parts :class:`crl.trainer.Trainer` is made of, one concept each (docs/design.md §12, "The trainer's parts"):

* :mod:`crl.training.accelerator` — accelerate / DeepSpeed set-up and the collectives over data-parallel ranks;
* :mod:`crl.training.models` — :class:`LearnerModels`: the policy, the critic, the frozen summariser, their optimizers
  and engines (the ZeRO stage and critic-free branches live here);
* :mod:`crl.training.sampler` — :class:`Sampler`: the generation backends, the weight sync and ``policy_version``
  (the backend branch lives here);
* :mod:`crl.training.update` — :class:`PPOUpdate`: estimator, losses, micro-batches and optimizer steps;
* :mod:`crl.training.checkpoints` — what a checkpoint holds and its model files; :class:`RunCheckpoints`: resume, checkpoints, evidence,
  rotation;
* :func:`crl.warm_start.warm_start_policy` — the warm start on one rank or all;
* :mod:`crl.streams` — the one place rollout ids and sampler seeds are computed.
"""
