package api

import (
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
)

func TestValidate(t *testing.T) {
	ok := []SandboxSpec{
		{},
		{Name: "a", Layers: []string{"ws:1", "bb:1"}, CPU: 2, Memory: 4 << 20, Pids: Unlimited, Disk: MinDisk, Class: SchedBatch},
		{Snapshot: "s:1", Memory: Unlimited, Disk: Unlimited, Env: []string{"A=", "B=c=d", "C"}, Workdir: "w", Hostname: strings.Repeat("h", 64)},
		{CPU: 1, CPURequest: 1, Memory: 1 << 30, MemoryRequest: 1 << 30},
		{Image: "python:3.12", Pull: PullNever}, {Image: "python:3.12", Pull: PullAlways}, {Image: "python:3.12", Pull: PullMissing},
	}
	for _, s := range ok {
		if err := s.Validate(); err != nil {
			t.Errorf("%+v: %v", s, err)
		}
	}
	bad := map[string]SandboxSpec{
		"bad sandbox name":         {Name: "a b"},
		"bad backend name":         {Backend: "../x"},
		"not both":                 {Snapshot: "s:1", Layers: []string{"bb:1"}},
		"an empty layer reference": {Layers: []string{"ws:1", " "}},
		"cpu -1 is negative":       {CPU: -1},
		"pids -2 is negative":      {Pids: -2},
		"memory_request -1":        {MemoryRequest: -1},
		"cpu NaN is not a size":    {CPU: math.NaN()},
		"disk quota 1048576 bytes": {Disk: 1 << 20},
		"too small to start":       {Memory: 1 << 20},
		"cpu request 2 > cpu 1":    {CPU: 1, CPURequest: 2},
		"memory request":           {Memory: 8 << 20, MemoryRequest: 9 << 20},
		`unknown class "urgent"`:   {Class: "urgent"},
		"bad environment entry":    {Env: []string{"A=\x00"}},
		"bad workdir":              {Workdir: "/w\x00"},
		"bad hostname":             {Hostname: strings.Repeat("h", 65)},
		`bad pull "sometimes"`:     {Image: "python:3.12", Pull: "sometimes"},
		"give --image too":         {Layers: []string{"bb:1"}, Pull: PullNever},
	}
	for want, s := range bad {
		err := s.Validate()
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v: %v, want invalid argument saying %q", s, err, want)
		}
	}
}

// FuzzValidate: a spec from any bytes is refused with an invalid
// argument or valid, and a valid one holds what the worker relies on.
func FuzzValidate(f *testing.F) {
	for _, s := range []string{`{}`, `{"name":"a","layers":["bb:1"],"memory":-1,"disk":16777216}`, `{"cpu":-1}`,
		`{"snapshot":"s:1","layers":["x"]}`, `{"env":["A\u0000"]}`, `{"class":"batch","memory":4194304,"memory_request":4194305}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var s SandboxSpec
		if json.Unmarshal(b, &s) != nil {
			return
		}
		err := s.Validate()
		if err != nil {
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("%+v: %v, not an invalid argument", s, err)
			}
			return
		}
		if s.Name != "" && ValidName(s.Name) != nil {
			t.Fatalf("valid with name %q", s.Name)
		}
		if s.Memory != Unlimited && s.Memory != 0 && s.Memory < MinMemory || s.Disk != Unlimited && s.Disk != 0 && s.Disk < MinDisk {
			t.Fatalf("valid with memory %d, disk %d", s.Memory, s.Disk)
		}
		if s.CPU < 0 || s.CPURequest < 0 || s.MemoryRequest < 0 || s.Pids < Unlimited || s.CPU > 0 && s.CPURequest > s.CPU {
			t.Fatalf("valid with cpu %g (request %g), memory request %d, pids %d", s.CPU, s.CPURequest, s.MemoryRequest, s.Pids)
		}
		if s.Class != "" && s.Class != SchedLatency && s.Class != SchedBatch || s.Snapshot != "" && len(s.Layers) > 0 {
			t.Fatalf("valid with class %q, snapshot %q over layers %q", s.Class, s.Snapshot, s.Layers)
		}
	})
}

// TestBatchRequestValidate: a batch of 1 to MaxBatch sandboxes whose
// last name is a name, and whose spec a create would take.
func TestBatchRequestValidate(t *testing.T) {
	long := strings.Repeat("a", 61)
	for _, c := range []struct {
		req BatchRequest
		ok  bool
	}{
		{BatchRequest{Count: 1}, true},
		{BatchRequest{Spec: SandboxSpec{Name: "r"}, Count: MaxBatch}, true},
		{BatchRequest{Count: 0}, false},
		{BatchRequest{Count: -1}, false},
		{BatchRequest{Count: MaxBatch + 1}, false},
		{BatchRequest{Spec: SandboxSpec{Name: long}, Count: 10}, true},  // long-9: 63
		{BatchRequest{Spec: SandboxSpec{Name: long}, Count: 11}, false}, // long-10: 64
		{BatchRequest{Spec: SandboxSpec{Name: "-x"}, Count: 2}, false},
		{BatchRequest{Spec: SandboxSpec{Snapshot: "s:1", Layers: []string{"l"}}, Count: 2}, false},
	} {
		if err := c.req.Validate(); (err == nil) != c.ok {
			t.Errorf("%+v: %v, want ok %v", c.req, err, c.ok)
		} else if err != nil && !errdefs.IsInvalidArgument(err) {
			t.Errorf("%+v: %v, not invalid argument", c.req, err)
		}
	}
}
