package lazy

import "time"

// SetTermGrace sets how long a fetcher told to exit waits for a new
// mount (termGrace), for the fetcher a test binary runs.
func SetTermGrace(d time.Duration) { termGrace = d }
