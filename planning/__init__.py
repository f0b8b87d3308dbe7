"""Planning on a laptop: how much memory, time and traffic a layout needs before any GPU
is allocated.

    meshtrain plan --model 70B --nodes 8 --gpu h100-80gb ...   # rank layouts
    meshtrain estimate --config X --world-size N                # one config's estimate
    meshtrain dry-run --config X --world-size N                  # trace one rank's real step

Each file has one concern; imports go one way, from the bottom of this list to the top
(tests/test_imports.py checks it). Below all of it, physics/gpus.py holds the GPUs.

    hardware.py     the cluster: NVLink, NICs per node, NCCL's collective algorithms and latencies
    shape.py        what is planned: the model's sizes, the job (a layout is parallel's ParallelDims)
    schedule.py     torch's pipeline schedules as lists of forwards and backwards
    kernels.py      compute seconds of a block, op class by op class
    param_passes.py bytes of the passes over the parameters: FSDP2's copies, clipping, AdamW
    shares.py       what each pipeline rank holds and runs
    fake_world.py   a fake process group and torch's memory tracker, for tracing
    collectives.py  a traced step's collectives, by mesh dimension
    activations.py  activation bytes, traced on a two-block copy of the model
    memory.py       peak memory per GPU
    step_time.py    step time: compute, exposed traffic, the bubble, the passes over the parameters
    report.py       estimates as text, and a layout as a train.py config
    estimate.py     memory + time = one layout's estimate; a train.py config's estimate
    forked.py       independent fake traces at once, one forked process per core
    alike_microbatches.py a pipeline rank's micro-batches alike an earlier one: a record repeated
    stages_apart.py a pipeline rank's stages traced in two processes at once
    traced_step.py  one rank's training step on fake tensors, as train.py builds it
    alike_blocks.py       a stretch of alike blocks traced with three, expanded
    alike_memory.py       the dry run at the real depth from three and four alike blocks
    dry_run.py      the dry run's report, beside the estimate
    representative_ranks.py   which ranks the hang check traces
    collective_record.py  a traced rank's collectives in order, per group
    collective_compare.py the hang check's comparisons
    collective_check.py   the hang check over representative ranks
    search.py       every valid layout, those that fit, fastest first
    verify.py       the top layouts dry-run and re-ranked
    plan.py         the planner's command line
"""
