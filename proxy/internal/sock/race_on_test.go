//go:build race

package sock

// raceEnabled: the race detector has sync.Pool drop a quarter of what is
// put back, so pooled objects are allocated now and then.
const raceEnabled = true
