// Package units reads the sizes users write: 1048576, 512K, 64M, 2GiB.
package units

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
)

// ParseBytes reads a size: bytes, or a number with K, M, G or T (powers
// of 1024; KiB-style suffixes and a trailing B are accepted too).
func ParseBytes(s string) (int64, error) {
	t := strings.TrimSuffix(strings.TrimSuffix(strings.ToUpper(strings.TrimSpace(s)), "B"), "I")
	mult := int64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'K':
			mult, t = 1<<10, t[:n-1]
		case 'M':
			mult, t = 1<<20, t[:n-1]
		case 'G':
			mult, t = 1<<30, t[:n-1]
		case 'T':
			mult, t = 1<<40, t[:n-1]
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v < 0 || v*float64(mult) > 1<<62 {
		return 0, fmt.Errorf("bad size %q: give bytes, or a number with K, M, G or T (powers of 1024): %w", s, errdefs.ErrInvalidArgument)
	}
	return int64(v * float64(mult)), nil
}
