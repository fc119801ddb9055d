package worker

import (
	"strings"
	"testing"

	"github.com/dsec-project/dsec/internal/runtime/cgroup"
)

// TestWorkerProtection: the defaults of the worker's memory protection
// fit the host reserve and an explicit min; what is set beyond the
// reserve, or a min over its low, is refused.
func TestWorkerProtection(t *testing.T) {
	const M = 1 << 20
	for _, c := range []struct {
		a    Admission
		want cgroup.Protection
		on   bool
		err  string
	}{
		{a: Admission{}, want: cgroup.Protection{Min: 128 * M, Low: 512 * M}, on: true},
		{a: Admission{HostReserve: 256 * M}, want: cgroup.Protection{Min: 128 * M, Low: 256 * M}, on: true},
		{a: Admission{HostReserve: 64 * M}, want: cgroup.Protection{Min: 64 * M, Low: 64 * M}, on: true},
		{a: Admission{WorkerMemoryMin: 768 * M}, want: cgroup.Protection{Min: 768 * M, Low: 768 * M}, on: true},
		{a: Admission{WorkerMemoryLow: 64 * M}, want: cgroup.Protection{Min: 64 * M, Low: 64 * M}, on: true},
		{a: Admission{WorkerMemoryLow: -1}, want: cgroup.Protection{Min: 128 * M}, on: true},
		{a: Admission{WorkerMemoryMin: -1, WorkerMemoryLow: -1}, on: false},
		{a: Admission{WorkerMemoryLow: 2048 * M}, err: "is more than admission.host_reserve (1024 MiB)"},
		{a: Admission{WorkerMemoryMin: 256 * M, WorkerMemoryLow: 128 * M}, err: "admission.worker_memory_min (256 MiB) is more than admission.worker_memory_low (128 MiB)"},
	} {
		err := c.a.Validate()
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%+v: %v, want %q", c.a, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%+v: %v", c.a, err)
			continue
		}
		if p, on := c.a.protection(); p != c.want || on != c.on {
			t.Errorf("%+v: protection %+v %v, want %+v %v", c.a, p, on, c.want, c.on)
		}
	}
}
