package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	stdslices "slices" // the package has a func named slices (manifests)
	"strings"
	"testing"
	"time"
)

// writeSoakRecord writes a soak's samples as a table (samples.tsv), its
// client errors with the event that explains each (errors.txt) and each
// figure's curve against time (curves.svg) into dir.
func writeSoakRecord(dir string, samples []soakSample, events []soakEvent, errs []soakError, explained func(soakError) string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var tsv strings.Builder
	tsv.WriteString("minutes\tworker\tworker_fds\tworker_rss_kib\tgoroutines\tconns\tflows\tunowned_fds\tunowned_goroutines\tkeeper_fds\tkeeper_rss_kib\tlive_conntrack\tlistening\trules\tclient_ops\terrors\tunexplained\n")
	for _, s := range samples {
		fmt.Fprintf(
			&tsv,
			"%.1f\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n",
			s.at.Minutes(),
			s.worker,
			s.workerFDs,
			s.workerRSSKiB,
			s.goroutines,
			s.conns,
			s.flows,
			s.unownedFDs,
			s.unownedGoroutines,
			s.keeperFDs,
			s.keeperRSSKiB,
			s.conntrack,
			s.listening,
			s.rules,
			s.connsTried,
			s.errors,
			s.unexplained,
		)
	}
	var txt strings.Builder
	kinds := map[string]int{}
	for _, ev := range events {
		kinds[ev.name]++
	}
	fmt.Fprintf(&txt, "events: %v\n", kinds)
	for _, e := range errs {
		why := explained(e)
		if why == "" {
			why = "UNEXPLAINED"
		}
		fmt.Fprintf(&txt, "%s\t%s\t%s\t%s\t%s\n", e.at.Format(time.RFC3339Nano), e.client, e.class, why, e.text)
	}
	if err := os.WriteFile(filepath.Join(dir, "samples.tsv"), []byte(tsv.String()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "errors.txt"), []byte(txt.String()), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "curves.svg"), []byte(soakSVG(samples)), 0o644)
}

// soakSVG draws each figure against time in a panel of its own, its axis
// from zero to its highest value, so that a flat line reads flat.
func soakSVG(samples []soakSample) string {
	const w, h, pad, cols = 360, 150, 36, 2
	figs := append(append([]soakFigure{}, soakFigures...), soakLifeFigures...)
	rows := (len(figs) + cols - 1) / cols
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", cols*w, rows*h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	if len(samples) == 0 {
		return b.String() + "</svg>\n"
	}
	end := max(samples[len(samples)-1].at.Minutes(), 1)
	for i, f := range figs {
		x0, y0 := float64(i%cols*w+pad), float64(i/cols*h+20)
		pw, ph := float64(w-2*pad), float64(h-pad-20)
		var v []int
		for _, s := range samples {
			v = append(v, f.get(s))
		}
		top := float64(max(stdslices.Max(v), 1))
		fmt.Fprintf(&b, `<text x="%.0f" y="%.0f">%s (0 – %d)</text>`+"\n", x0, y0-6, f.name, int(top))
		fmt.Fprintf(&b, `<rect x="%.0f" y="%.0f" width="%.0f" height="%.0f" fill="none" stroke="#999"/>`+"\n", x0, y0, pw, ph)
		var pts []string
		for j, s := range samples {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x0+pw*s.at.Minutes()/end, y0+ph-ph*float64(v[j])/top))
		}
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="#1f77b4" stroke-width="1.5"/>`+"\n", strings.Join(pts, " "))
		fmt.Fprintf(&b, `<text x="%.0f" y="%.0f">0</text><text x="%.0f" y="%.0f" text-anchor="end">%.0f min</text>`+"\n",
			x0, y0+ph+13, x0+pw, y0+ph+13, end)
	}
	return b.String() + "</svg>\n"
}

func TestLogLineTime(t *testing.T) {
	at, ok := logLineTime(`time="2026-12-06T20:35:58Z" level=info msg="Took over" service=default/web`)
	if !ok || !at.Equal(time.Date(2026, 12, 6, 20, 35, 58, 0, time.UTC)) {
		t.Errorf("got %v %v", at, ok)
	}
	if _, ok := logLineTime(`level=info msg="no time"`); ok {
		t.Error("a line without time= read as timed")
	}
}
