package api

import (
	"fmt"
	"regexp"
	"strings"
	"sync"

	"github.com/containerd/errdefs"
)

var nameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$`) })

// ValidName says whether name may name a sandbox.
func ValidName(name string) error {
	if !nameRE().MatchString(name) {
		return fmt.Errorf("bad sandbox name %q: use up to 63 letters, digits, '_', '.' and '-': %w", name, errdefs.ErrInvalidArgument)
	}
	return nil
}

// CheckClass refuses an unknown scheduling class ("" is the default).
func CheckClass(class string) error {
	switch class {
	case "", SchedLatency, SchedBatch:
		return nil
	}
	return fmt.Errorf("unknown class %q: use %s (interactive steps) or %s (background work): %w", class, SchedLatency, SchedBatch, errdefs.ErrInvalidArgument)
}

// CheckDisk says whether size can be a sandbox's own disk quota (0:
// none of its own).
func CheckDisk(size int64) error {
	if size < 0 || (size > 0 && size < MinDisk) {
		return fmt.Errorf("disk quota %d bytes is too small: give at least %d MiB, or no quota of its own (the default bound): %w", size, MinDisk>>20, errdefs.ErrInvalidArgument)
	}
	return nil
}

// MinMemory is the smallest memory limit a sandbox starts under.
const MinMemory = 4 << 20

// Validate checks a spec on its own, without the worker's state (which
// layers, policies and backends exist is the worker's to say): what the
// worker checks once, before it does anything with a request. An empty
// Name is valid (the worker picks one).
func (s *SandboxSpec) Validate() error {
	if s.Name != "" {
		if err := ValidName(s.Name); err != nil {
			return err
		}
	}
	if s.Backend != "" && !nameRE().MatchString(s.Backend) {
		return fmt.Errorf("bad backend name %q: %w", s.Backend, errdefs.ErrInvalidArgument)
	}
	if s.Snapshot != "" && len(s.Layers) > 0 {
		return fmt.Errorf("a sandbox starts on a snapshot or on layers, not both: %w", errdefs.ErrInvalidArgument)
	}
	if s.Snapshot != "" && s.Image != "" {
		return fmt.Errorf("a sandbox starts on a snapshot or on an image, not both (a snapshot knows the layers it was taken on): %w", errdefs.ErrInvalidArgument)
	}
	if s.Image != "" && (len(s.Image) > 1024 || strings.ContainsAny(s.Image, " \t\r\n")) {
		return fmt.Errorf("bad image %q: give NAME[:TAG] or NAME@DIGEST, e.g. python:3.12: %w", s.Image, errdefs.ErrInvalidArgument)
	}
	if err := CheckPull(s.Pull); err != nil {
		return err
	}
	if s.Pull != "" && s.Image == "" {
		return fmt.Errorf("pull %s says when an image is fetched, and this sandbox has none: give --image too: %w", s.Pull, errdefs.ErrInvalidArgument)
	}
	if s.DiskOnly && s.Snapshot == "" && s.Backend != "vm" { // (a vm sandbox's base may be a memory snapshot)
		return fmt.Errorf("--disk-only starts a sandbox on a snapshot's files alone: give the snapshot too: %w", errdefs.ErrInvalidArgument)
	}
	for _, l := range s.Layers {
		if strings.TrimSpace(l) == "" {
			return fmt.Errorf("an empty layer reference in %q: %w", s.Layers, errdefs.ErrInvalidArgument)
		}
	}
	for _, r := range []struct {
		name string
		v    float64
	}{{"cpu", s.CPU}, {"memory", float64(s.Memory)}, {"pids", float64(s.Pids)}, {"disk", float64(s.Disk)},
		{"cpu_request", s.CPURequest}, {"memory_request", float64(s.MemoryRequest)}} {
		if r.v < 0 && !(r.v == Unlimited && (r.name == "memory" || r.name == "pids" || r.name == "disk")) {
			return fmt.Errorf("%s %g is negative: give 0 (the default) or more (memory, pids and disk: -1 for no limit of its own): %w", r.name, r.v, errdefs.ErrInvalidArgument)
		}
		if r.v != r.v || r.v > 1e18 { // NaN, or beyond any host
			return fmt.Errorf("%s %g is not a size: %w", r.name, r.v, errdefs.ErrInvalidArgument)
		}
	}
	if err := CheckDisk(max(s.Disk, 0)); err != nil {
		return err
	}
	if s.Memory > 0 && s.Memory < MinMemory {
		return fmt.Errorf("memory limit %d bytes is too small to start a sandbox: give at least %d MiB: %w", s.Memory, MinMemory>>20, errdefs.ErrInvalidArgument)
	}
	if s.CPU > 0 && s.CPURequest > s.CPU {
		return fmt.Errorf("a request above its limit: cpu request %g > cpu %g (a sandbox cannot use more than its limit): %w", s.CPURequest, s.CPU, errdefs.ErrInvalidArgument)
	}
	if s.Memory > 0 && s.MemoryRequest > s.Memory {
		return fmt.Errorf("a request above its limit: memory request %d > memory %d bytes (a sandbox cannot use more than its limit): %w", s.MemoryRequest, s.Memory, errdefs.ErrInvalidArgument)
	}
	if err := CheckClass(s.Class); err != nil {
		return err
	}
	// What no exec could start with (execve refuses a NUL byte): refused
	// here, not at the first command.
	for _, kv := range s.Env {
		if strings.ContainsRune(kv, 0) {
			return fmt.Errorf("bad environment entry %q: a NUL byte: %w", kv, errdefs.ErrInvalidArgument)
		}
	}
	if strings.ContainsRune(s.Workdir, 0) {
		return fmt.Errorf("bad workdir %q: a NUL byte: %w", s.Workdir, errdefs.ErrInvalidArgument)
	}
	if len(s.User) > 256 || strings.ContainsAny(s.User, "\x00\n") {
		return fmt.Errorf("bad user %q: give a user name, a uid or uid:gid: %w", s.User, errdefs.ErrInvalidArgument)
	}
	if len(s.Hostname) > 64 || strings.ContainsRune(s.Hostname, 0) { // sethostname(2)'s bound
		return fmt.Errorf("bad hostname %q: give up to 64 bytes: %w", s.Hostname, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Validate refuses a batch of no sandboxes, or of too many, or whose
// spec no create would take (its last sandbox's name included).
func (r BatchRequest) Validate() error {
	if r.Count < 1 || r.Count > MaxBatch {
		return fmt.Errorf("a batch of %d sandboxes: ask for 1 to %d: %w", r.Count, MaxBatch, errdefs.ErrInvalidArgument)
	}
	spec := r.Spec
	if spec.Name != "" {
		spec.Name = BatchName(spec.Name, r.Count-1)
	}
	return spec.Validate()
}

// BatchName is the name of a batch's sandbox i, of its spec's name.
func BatchName(name string, i int) string { return fmt.Sprintf("%s-%d", name, i) }

// CheckPull refuses a SandboxSpec.Pull that is none of its values.
func CheckPull(pull string) error {
	switch pull {
	case "", PullMissing, PullNever, PullAlways:
		return nil
	}
	return fmt.Errorf("bad pull %q: give missing (the default), never or always: %w", pull, errdefs.ErrInvalidArgument)
}
