package lazy

import (
	"fmt"
	"time"
)

// SetTermGrace sets how long a fetcher told to exit waits for a new
// mount (termGrace), for the fetcher a test binary runs.
func SetTermGrace(d time.Duration) { termGrace = d }

// PhysicalStart is where in the image a file's first extent lies.
func PhysicalStart(p string) (int64, error) {
	exts, err := fiemap(p)
	if err != nil || len(exts) == 0 {
		return 0, fmt.Errorf("fiemap %s: %v (%d extents)", p, err, len(exts))
	}
	return exts[0].Physical, nil
}
