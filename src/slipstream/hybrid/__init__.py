"""Hybrid decode: a streamed layer's FFN split between the GPU and the CPU, so that the CPU
computes part of each pinned layer while PCIe brings the rest.

    split    the split along the FFN's units: which layers split, their two shares' weights
    share    the CPU's side: its packed linears and HostFFN, which computes the CPU's share
    host_io  HostIO: the pinned buffers, the worker thread and the hand-off that orders the
             CPU's shares on the CUDA stream (the wait kernels in kernels/host_wait.py)
    probe    what the CPU's kernel does on this machine, beside the copies
    plan     how much of each layer the CPU takes (HybridPlan), from the probes
    balance  how many split layers the CPU keeps serving while decoding
    policy   HybridSplit: the load's and the CUDA store's view of all of it (the store's
             SplitPolicy, memory.cuda_store)
"""
