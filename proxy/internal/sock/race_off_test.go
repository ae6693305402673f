//go:build !race

package sock

const raceEnabled = false
