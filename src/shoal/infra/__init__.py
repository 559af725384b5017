"""Process infrastructure below everything else: starting workers (launch, pool), the default process group
as a whole (world), the C allocator of CPU workers (host_memory), hang detection (watchdog) and the fault
injection of the fault suite (faults)."""
