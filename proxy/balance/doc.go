// Package balance chooses the endpoint of each new connection or UDP flow of
// one frontend: the schedulers (rr, lc, sh, random), ClientIP affinity,
// passive outlier ejection and drains set by hand, and the pick state a
// successor takes over in a handover.
//
// It owns a Balancer's endpoints, pins and counters; callers own the
// connections and report each dial's outcome (Report) and end (Done). It
// imports nothing of this project: every value it takes is plain data.
package balance
