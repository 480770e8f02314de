"""Splitting one model over several processes (chapter 15), with PyTorch's ``torch.distributed``
(gloo on the CPU, nccl on CUDA): ``launch`` starts the ranks (or joins those ``torchrun``
started), ``comm`` counts every byte a collective moves, ``tensor`` shards each layer across the
ranks (Megatron-style, by hand, and through DTensor), ``pipeline`` gives each rank a run of
consecutive layers, ``context`` splits the sequence (ring attention), ``expert`` puts a
mixture-of-experts layer's experts on different ranks (all-to-all dispatch and combine, its bytes
and its load imbalance), ``predict`` turns counted bytes and a link into predicted times, and
``cli_ranks`` runs ``python -m minillm generate --tensor-parallel N`` / ``--pipeline-parallel N``
on its ranks. Whole replicas behind a router are serving's (``minillm.serving.replicas``).
"""
