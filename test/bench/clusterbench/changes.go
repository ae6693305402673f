package main

// The Services and EndpointSlices a run creates, the changes a proxy is timed
// by (one add, change and delete, and a churn of endpoint changes), and the
// live page's and profiles' requests to our daemon.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// until polls cond every 2 ms.
func (b *bench) until(ctx context.Context, limit time.Duration, cond func() bool) error {
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(2 * time.Millisecond)
	}
	return nil
}

type probe struct{ name, addr string }

// probeService creates a Service whose endpoint is backend A, and waits
// until it answers.
func (b *bench) probeService(ctx context.Context, name string, octet int) (probe, error) {
	p := probe{name: name, addr: fmt.Sprintf("10.96.%d.1:80", octet)}
	if _, err := b.client.CoreV1().Services("bench").Create(ctx, service(name, strings.TrimSuffix(p.addr, ":80")), metav1.CreateOptions{}); err != nil {
		return p, err
	}
	if _, err := b.client.DiscoveryV1().EndpointSlices("bench").Create(ctx, slice(name, []string{"10.244.0.1"}, 8080), metav1.CreateOptions{}); err != nil {
		return p, err
	}
	return p, b.until(ctx, 3*time.Minute, func() bool { return b.cur.answer(p.addr) == "A" })
}

// watchEvents records when each Service and EndpointSlice event of the
// bench namespace arrives, from now on, until ctx ends.
func (b *bench) watchEvents(ctx context.Context) error {
	b.seen = map[string]time.Time{}
	for _, kind := range []string{"service", "slice"} {
		var w watch.Interface
		var err error
		// From the current resource version: no event for what exists.
		if kind == "service" {
			l, lerr := b.client.CoreV1().Services("bench").List(ctx, metav1.ListOptions{Limit: 1})
			if lerr != nil {
				return lerr
			}
			w, err = b.client.CoreV1().Services("bench").Watch(ctx, metav1.ListOptions{ResourceVersion: l.ResourceVersion})
		} else {
			l, lerr := b.client.DiscoveryV1().EndpointSlices("bench").List(ctx, metav1.ListOptions{Limit: 1})
			if lerr != nil {
				return lerr
			}
			w, err = b.client.DiscoveryV1().EndpointSlices("bench").Watch(ctx, metav1.ListOptions{ResourceVersion: l.ResourceVersion})
		}
		if err != nil {
			return err
		}
		go func() {
			defer w.Stop()
			for ev := range w.ResultChan() {
				now := time.Now()
				if m, err := meta.Accessor(ev.Object); err == nil {
					b.seenMu.Lock()
					b.seen[kind+"/"+m.GetName()] = now
					b.seenMu.Unlock()
				}
			}
		}()
	}
	return nil
}

// sinceEvent is how long before at the first event of key at or after
// from arrived (0 when none came within 5 s).
func (b *bench) sinceEvent(key string, from, at time.Time) time.Duration {
	deadline := time.Now().Add(5 * time.Second)
	for {
		b.seenMu.Lock()
		t, ok := b.seen[key]
		b.seenMu.Unlock()
		if ok && !t.Before(from) {
			return at.Sub(t)
		}
		if time.Now().After(deadline) {
			return 0
		}
		time.Sleep(time.Millisecond)
	}
}

// oneChange measures an add (Service, then its slice: from the slice's
// API call, and from its watch event), a change (the slice's endpoint
// from A to B) and a delete; [0] from the API call, [1] from the event.
func (b *bench) oneChange(ctx context.Context, i int) (add, change, del [2]time.Duration, err error) {
	name := fmt.Sprintf("probe-%d", i)
	ip := fmt.Sprintf("10.96.%d.1", 210+i)
	// Each measured change is a lone one: after a quiet time longer than
	// the daemon's rate limit needs to refill (2 × --min-sync-period).
	lone := func() { time.Sleep(2500 * time.Millisecond) }
	lone()
	if _, err = b.client.CoreV1().Services("bench").Create(ctx, service(name, ip), metav1.CreateOptions{}); err != nil {
		return
	}
	called := time.Now()
	if _, err = b.client.DiscoveryV1().EndpointSlices("bench").Create(ctx, slice(name, []string{"10.244.0.1"}, 8080), metav1.CreateOptions{}); err != nil {
		return
	}
	t := time.Now()
	if err = b.until(ctx, 3*time.Minute, func() bool { return b.cur.answer(ip+":80") == "A" }); err != nil {
		return
	}
	done := time.Now()
	add = [2]time.Duration{done.Sub(t), b.sinceEvent("slice/"+name, called, done)}
	if b.o.logs != "" { // to line up with the daemon's log
		fmt.Fprintf(os.Stderr, "%s add %s: %v from the call, %v from the slice's event\n", done.UTC().Format("15:04:05.000"), name, add[0], add[1])
	}
	lone()
	var at time.Time
	called = time.Now()
	if change[0], at, err = b.switchBackend(ctx, probe{name: name, addr: ip + ":80"}); err != nil {
		return
	}
	change[1] = b.sinceEvent("slice/"+name, called, at)
	lone()
	// The probes start before the call: the API server answers a DELETE
	// 40-90 ms after its watch event, and the daemon refuses before that.
	refused := make(chan error, 1)
	var refusedAt time.Time
	pctx, stopProbes := context.WithCancel(ctx)
	go func() {
		err := b.until(pctx, 3*time.Minute, func() bool { return !b.cur.accepts(ip + ":80") })
		refusedAt = time.Now()
		refused <- err
	}()
	called = time.Now()
	if err = b.client.CoreV1().Services("bench").Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		stopProbes()
		<-refused
		return
	}
	t = time.Now()
	err = <-refused
	stopProbes()
	if err != nil {
		return
	}
	// From the call's answer: 0 when refused before it came.
	del = [2]time.Duration{max(refusedAt.Sub(t), 0), b.sinceEvent("service/"+name, called, refusedAt)}
	_ = b.client.DiscoveryV1().EndpointSlices("bench").Delete(ctx, name, metav1.DeleteOptions{})
	return
}

// switchBackend moves the probe's endpoint to the other backend and returns
// how long after the API call traffic reached it, and when.
func (b *bench) switchBackend(ctx context.Context, p probe) (time.Duration, time.Time, error) {
	want, addr := "B", "10.244.0.2"
	if b.cur.answer(p.addr) == "B" {
		want, addr = "A", "10.244.0.1"
	}
	es, err := b.client.DiscoveryV1().EndpointSlices("bench").Get(ctx, p.name, metav1.GetOptions{})
	if err != nil {
		return 0, time.Time{}, err
	}
	es.Endpoints[0].Addresses = []string{addr}
	if _, err := b.client.DiscoveryV1().EndpointSlices("bench").Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		return 0, time.Time{}, err
	}
	t := time.Now()
	err = b.until(ctx, 3*time.Minute, func() bool { return b.cur.answer(p.addr) == want })
	done := time.Now()
	return done.Sub(t), done, err
}

// churn flips one endpoint's readiness in a random slice, rate times a
// second, for the churn's duration.
func (b *bench) churn(ctx context.Context) error {
	r := rand.New(rand.NewPCG(1, 2))
	tick := time.NewTicker(time.Second / time.Duration(b.o.rate))
	defer tick.Stop()
	end := time.Now().Add(b.o.churn)
	for time.Now().Before(end) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		name := fmt.Sprintf("s%d", r.IntN(b.o.n))
		es, err := b.client.DiscoveryV1().EndpointSlices("bench").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		k := r.IntN(len(es.Endpoints))
		ready := es.Endpoints[k].Conditions.Ready == nil || *es.Endpoints[k].Conditions.Ready
		es.Endpoints[k].Conditions.Ready = ptr(!ready)
		if _, err := b.client.DiscoveryV1().EndpointSlices("bench").Update(ctx, es, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

// cpuProfile saves the daemon's CPU profile over d to the -profile file.
func (b *bench) cpuProfile(d time.Duration) error {
	return b.save(fmt.Sprintf("/debug/pprof/profile?seconds=%d", int(d.Seconds())), b.o.profile, d+30*time.Second)
}

// pageRequests are what the live page fetches on each refresh
// (cmd/kube-userspace-proxy/ui/index.html, refresh()): at once, and the next
// refresh a second after the last answer; the rules every rulesEvery
// refreshes, from the first.
var pageRequests = []string{"/debug/services?limit=500", "/debug/connections?limit=500", "/debug/log?n=50"}

const (
	pageRules  = "/debug/rules?format=json"
	rulesEvery = 10
)

// pollPage makes the live page's requests for d, as the page does, and
// returns how many refreshes it made.
func (b *bench) pollPage(ctx context.Context, d time.Duration) (int, error) {
	c := &http.Client{Timeout: time.Minute, Transport: &http.Transport{DialContext: cluster.DialContextIn(b.cur.ns)}}
	get := func(path string) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:10249"+path, nil)
		if err != nil {
			return err
		}
		req.Header.Set("Accept", "application/json")
		resp, err := c.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %s", path, resp.Status)
		}
		return nil
	}
	end := time.Now().Add(d)
	n := 0
	for ; time.Now().Before(end); n++ {
		paths := pageRequests
		if n%rulesEvery == 0 {
			paths = append(slices.Clone(paths), pageRules)
		}
		errs := make(chan error, len(paths))
		for _, path := range paths {
			go func() { errs <- get(path) }()
		}
		for range paths {
			if err := <-errs; err != nil {
				return n, err
			}
		}
		select {
		case <-ctx.Done():
			return n, ctx.Err()
		case <-time.After(time.Second):
		}
	}
	return n, nil
}

// save writes what the daemon's metrics server answers on path to file.
func (b *bench) save(path, file string, timeout time.Duration) error {
	c := &http.Client{Timeout: timeout, Transport: &http.Transport{DialContext: cluster.DialContextIn(b.cur.ns)}}
	resp, err := c.Get("http://127.0.0.1:10249" + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(f, resp.Body)
	return err
}

// timeChanges times one change at a time, from the API call and from the
// watch event (this process's own watch: about when the proxy's saw it).
func (b *bench) timeChanges(ctx context.Context) error {
	if b.o.runs == 0 {
		return nil
	}
	if b.seen == nil {
		if err := b.watchEvents(ctx); err != nil {
			return err
		}
	}
	var adds, changes, deletes [2][]time.Duration
	for i := 0; i < b.o.runs; i++ {
		a, c, del, err := b.oneChange(ctx, i)
		if err != nil {
			return err
		}
		for k := range 2 {
			adds[k], changes[k], deletes[k] = append(adds[k], a[k]), append(changes[k], c[k]), append(deletes[k], del[k])
		}
	}
	b.record("add a Service and its slice → traffic, from the API call (median / max)", medMax(adds[0]))
	b.record("add a Service and its slice → traffic, from the slice's watch event", medMax(adds[1]))
	b.record("change a slice's endpoint → traffic, from the API call", medMax(changes[0]))
	b.record("change a slice's endpoint → traffic, from the watch event", medMax(changes[1]))
	b.record("delete a Service → traffic refused, from the API call", medMax(deletes[0]))
	b.record("delete a Service → traffic refused, from the watch event", medMax(deletes[1]))
	return nil
}

// timeChurn makes endpoint changes at a steady rate, then one more change
// whose latency says whether a lag built up.
func (b *bench) timeChurn(ctx context.Context, n *node, p *proc) error {
	if b.o.churn == 0 {
		return nil
	}
	cpu0 := p.cpu()
	pr, err := b.probeService(ctx, "churn-probe", 200)
	if err != nil {
		return err
	}
	profiled := make(chan error, 1)
	if n.proxy == ours && b.o.profile != "" {
		go func() { profiled <- b.cpuProfile(30 * time.Second) }()
	} else {
		profiled <- nil
	}
	if err := b.churn(ctx); err != nil {
		return err
	}
	if err := <-profiled; err != nil {
		return fmt.Errorf("profile: %w", err)
	}
	lag, _, err := b.switchBackend(ctx, pr)
	if err != nil {
		return err
	}
	b.record(fmt.Sprintf("churn: %d endpoint changes/s for %s, proxy CPU", b.o.rate, b.o.churn), fmt.Sprintf("%.1f s", p.cpu()-cpu0))
	b.record("churn: the change after the last one → traffic (lag)", ms(lag))
	b.record("RSS after the churn", mib(p.rss()))
	return b.deleteProbe(ctx, pr.name)
}

// deleteProbe deletes a probe's Service and slice, so that the next
// proxy's run creates them anew.
func (b *bench) deleteProbe(ctx context.Context, name string) error {
	if err := b.client.CoreV1().Services("bench").Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return err
	}
	return b.client.DiscoveryV1().EndpointSlices("bench").Delete(ctx, name, metav1.DeleteOptions{})
}

func clusterIP(i int) string { return fmt.Sprintf("10.96.%d.%d", (i+1)/250, (i+1)%250+1) }

// createAll creates the Services and their slices, 32 at a time.
func (b *bench) createAll(ctx context.Context) error {
	var next atomic.Int64
	errs := make(chan error, 32)
	var wg sync.WaitGroup
	for w := 0; w < 32; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < b.o.n; i = int(next.Add(1)) - 1 {
				name := fmt.Sprintf("s%d", i)
				if _, err := b.client.CoreV1().Services("bench").Create(ctx, service(name, clusterIP(i)), metav1.CreateOptions{}); err != nil {
					errs <- err
					return
				}
				var addrs []string
				for k := 0; k < b.o.m; k++ {
					e := i*b.o.m + k
					addrs = append(addrs, fmt.Sprintf("10.244.%d.%d", 1+e/250, e%250+1))
				}
				if _, err := b.client.DiscoveryV1().EndpointSlices("bench").Create(ctx, slice(name, addrs, bulkPort), metav1.CreateOptions{}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func service(name, ip string) *v1.Service {
	return &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "bench"},
		Spec: v1.ServiceSpec{ClusterIP: ip, Ports: []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}}}
}

func slice(service string, addrs []string, port int32) *discovery.EndpointSlice {
	es := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: service, Namespace: "bench", Labels: map[string]string{discovery.LabelServiceName: service}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr("http"), Port: ptr(port), Protocol: ptr(v1.ProtocolTCP)}},
	}
	for _, a := range addrs {
		es.Endpoints = append(es.Endpoints, discovery.Endpoint{Addresses: []string{a}, Conditions: discovery.EndpointConditions{Ready: ptr(true)}})
	}
	return es
}

func ptr[T any](v T) *T { return &v }
