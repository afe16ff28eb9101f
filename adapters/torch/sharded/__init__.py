"""The torch adapter's back-ends for sharded and parallel training: DeepSpeed ZeRO 0-3
(``deepspeed``), megatron-core's optimizers and gradient buckets (``megatron``,
``megatron_grads``), FSDP2 and FSDP1 (``fsdp``, ``fsdp_flat``, with FSDP's private state read only
in ``fsdp_internals``), DTensor parameters (``dtensor``), and the exact merge of each rank's
piece of a sharded tensor (``shards``).

The DeepSpeed and megatron back-ends are imported only when their optimizer or model is seen, so
a plain torch run never imports either framework.
"""
