//go:build !linux

package agent

// MaybeRun returns at once: microVMs need Linux.
func MaybeRun() {}
