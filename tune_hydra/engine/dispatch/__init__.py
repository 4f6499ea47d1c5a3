"""Dispatch: which task's op each device runs next, the device workers that run it, the
leases that hold a shard's state on a device meanwhile, and the batched pass of a shared
frozen shard for several tasks at once."""
