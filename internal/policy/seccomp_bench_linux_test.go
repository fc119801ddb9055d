package policy

import (
	"encoding/binary"
	"runtime"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// load times seccomp(2) loading prog on a thread of its own, which dies
// with the filter.
func load(b *testing.B, prog []byte) time.Duration {
	out := make(chan time.Duration)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with its filter
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			b.Error(err)
		}
		filter := make([]unix.SockFilter, len(prog)/8)
		for i := range filter {
			p := prog[8*i:]
			filter[i] = unix.SockFilter{Code: binary.NativeEndian.Uint16(p), Jt: p[2], Jf: p[3], K: binary.NativeEndian.Uint32(p[4:])}
		}
		fprog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
		t0 := time.Now()
		_, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&fprog)))
		d := time.Since(t0)
		if errno != 0 {
			b.Error(errno)
		}
		out <- d
	}()
	return <-out
}

// BenchmarkSeccompLoad: loading the default profile as a binary search
// (what sandboxes get) next to the library's chain of comparisons.
func BenchmarkSeccompLoad(b *testing.B) {
	a, err := arch.GetInfo("")
	if err != nil {
		b.Skipf("no seccomp tables for this architecture: %v", err)
	}
	tree, err := Seccomp(nil)
	if err != nil {
		b.Fatal(err)
	}
	lib, err := chain(a, Denied, allowed, nil)
	if err != nil {
		b.Fatal(err)
	}
	raw, err := bpf.Assemble(lib)
	if err != nil {
		b.Fatal(err)
	}
	chained := encode(raw)
	var t, c []time.Duration
	for b.Loop() {
		t, c = append(t, load(b, tree)), append(c, load(b, chained))
	}
	p50 := func(d []time.Duration) float64 { slices.Sort(d); return float64(d[len(d)/2].Nanoseconds()) / 1e3 }
	b.ReportMetric(p50(t), "search-p50-us")
	b.ReportMetric(p50(c), "chain-p50-us")
	b.ReportMetric(p50(t)/p50(c), "ratio")
	b.ReportMetric(float64(len(tree)/8), "search-insns")
	b.ReportMetric(float64(len(raw)), "chain-insns")
}
