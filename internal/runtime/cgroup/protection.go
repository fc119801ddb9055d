package cgroup

// Protection is the memory the worker and its fetchers keep when the
// host runs short: Min is never reclaimed from them (memory.min), Low
// only once nothing unprotected is left to reclaim (memory.low). Zero
// leaves one off.
type Protection struct {
	Min, Low int64
}
