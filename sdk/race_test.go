//go:build race

package sdk_test

// raceEnabled: the race detector runs, and a process takes several times
// the memory it would without.
const raceEnabled = true
