package remote

import (
	"io"
	"os"
	"strings"
	"time"

	"github.com/dsec-project/dsec/internal/units"
)

// Emulation slows reads from a dir: remote down to a given round-trip
// latency and bandwidth, so benchmarks on one machine can stand for a
// store across a network. It is set with DSEC_EMULATE_REMOTE, for example
// "latency=2ms,bandwidth=100MiB" (bandwidth in bytes per second), and is
// off when unset. Nothing but benchmarks should set it.
type Emulation struct {
	Latency   time.Duration
	Bandwidth int64 // bytes per second; 0: unlimited
}

// EmulationFromEnv reads DSEC_EMULATE_REMOTE.
func EmulationFromEnv() Emulation {
	var e Emulation
	for _, kv := range strings.Split(os.Getenv("DSEC_EMULATE_REMOTE"), ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(kv), "=")
		switch k {
		case "latency":
			e.Latency, _ = time.ParseDuration(v)
		case "bandwidth":
			e.Bandwidth = parseBytes(v)
		}
	}
	return e
}

func parseBytes(s string) int64 {
	n, _ := units.ParseBytes(s)
	return n
}

// Request waits one round trip before a request's first byte.
func (e Emulation) Request() {
	if e.Latency > 0 {
		time.Sleep(e.Latency)
	}
}

// Transfer waits as long as n bytes take at the emulated bandwidth.
func (e Emulation) Transfer(n int) {
	if e.Bandwidth > 0 && n > 0 {
		time.Sleep(time.Duration(int64(n) * int64(time.Second) / e.Bandwidth))
	}
}

// Reader wraps r so its bytes arrive at the emulated pace.
func (e Emulation) Reader(r io.ReadCloser) io.ReadCloser {
	if e.Latency == 0 && e.Bandwidth == 0 {
		return r
	}
	e.Request()
	return emulatedReader{r, e}
}

type emulatedReader struct {
	io.ReadCloser
	e Emulation
}

func (r emulatedReader) Read(p []byte) (int, error) {
	n, err := r.ReadCloser.Read(p)
	r.e.Transfer(n)
	return n, err
}
