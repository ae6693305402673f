package config

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// ManifestError locates a problem in a manifests file: which file, which
// document (1-based), which List item, and what is wrong.
type ManifestError struct {
	File     string
	Document int
	Item     string // "items[3]" inside a List, else ""
	Object   string // "Service dev/devpaasy" once known
	Err      error
}

func (e *ManifestError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: document %d", e.File, e.Document)
	if e.Item != "" {
		b.WriteString(" " + e.Item)
	}
	if e.Object != "" {
		b.WriteString(" (" + e.Object + ")")
	}
	b.WriteString(": " + e.Err.Error())
	return b.String()
}

func (e *ManifestError) Unwrap() error { return e.Err }

// manifestFiles lists the files a --manifests path stands for: the file
// itself, or every *.yaml, *.yml and *.json directly inside a directory.
func manifestFiles(path string) ([]string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("manifests: %w", err)
	}
	if !fi.IsDir() {
		return []string{path}, nil
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("manifests: %w", err)
	}
	var files []string
	for _, e := range entries {
		if e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		switch strings.ToLower(filepath.Ext(e.Name())) {
		case ".yaml", ".yml", ".json":
			files = append(files, filepath.Join(path, e.Name()))
		}
	}
	sort.Strings(files)
	return files, nil
}

// Skipped records an object that was read but is not proxied, and why.
type Skipped struct {
	Object string
	Reason string
}

// LoadManifests reads a manifests file or directory and builds the State for node.
// The first invalid document is returned as a *ManifestError.
func LoadManifests(path, node string) (*State, []Skipped, error) {
	files, err := manifestFiles(path)
	if err != nil {
		return nil, nil, err
	}
	p := newManifestParser(node)
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, nil, fmt.Errorf("manifests: %w", err)
		}
		if err := p.parseFile(f, data); err != nil {
			return nil, nil, err
		}
	}
	return p.finish(), p.skipped, nil
}

// ParseManifests parses one file's content (used by tests and the fuzz target).
func ParseManifests(name string, data []byte, node string) (*State, error) {
	p := newManifestParser(node)
	if err := p.parseFile(name, data); err != nil {
		return nil, err
	}
	return p.finish(), nil
}

type manifestParser struct {
	b       *Builder
	skipped []Skipped
	// v1 Endpoints are converted only for Services that have no EndpointSlice,
	// so that `kubectl get svc,ep,endpointslices -o yaml` does not count every
	// endpoint twice.
	legacy []*discovery.EndpointSlice
	slices map[[2]string]bool
}

func newManifestParser(node string) *manifestParser {
	return &manifestParser{b: NewBuilder(node), slices: map[[2]string]bool{}}
}

func (p *manifestParser) finish() *State {
	for _, es := range p.legacy {
		key := [2]string{es.Namespace, es.Labels[LabelServiceName]}
		if p.slices[key] {
			p.skipped = append(p.skipped, Skipped{Object: "Endpoints " + key[0] + "/" + key[1], Reason: "the Service has EndpointSlices, which take precedence"})
			continue
		}
		// Converted slices were validated when the Endpoints object was read.
		_, _ = p.b.AddSlice(es)
	}
	return p.b.State()
}

func (p *manifestParser) parseFile(file string, data []byte) error {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for doc := 1; ; doc++ {
		raw, err := r.Read()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return &ManifestError{File: file, Document: doc, Err: err}
		}
		if len(bytes.TrimSpace(stripComments(raw))) == 0 {
			doc-- // comment-only or empty documents are not counted
			continue
		}
		js, err := yaml.YAMLToJSON(raw)
		if err != nil {
			return &ManifestError{File: file, Document: doc, Err: err}
		}
		if err := p.parseObject(js); err != nil {
			var me *ManifestError
			if errors.As(err, &me) {
				me.File, me.Document = file, doc
				return me
			}
			return &ManifestError{File: file, Document: doc, Err: err}
		}
	}
}

func stripComments(doc []byte) []byte {
	var out [][]byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(line); len(t) > 0 && t[0] != '#' {
			out = append(out, line)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
}

func (p *manifestParser) parseObject(js []byte) error {
	if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
		return nil
	}
	var tm typeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return fmt.Errorf("not a Kubernetes object: %w", err)
	}
	if tm.Kind == "" || tm.APIVersion == "" {
		return errors.New("apiVersion and kind are required")
	}
	ns := tm.Metadata.Namespace
	if ns == "" {
		ns = "default"
	}
	obj := fmt.Sprintf("%s %s/%s", tm.Kind, ns, tm.Metadata.Name)
	wrap := func(err error) error { return &ManifestError{Object: obj, Err: cleanJSONError(err)} }

	switch {
	case tm.APIVersion == "v1" && strings.HasSuffix(tm.Kind, "List"):
		var list struct {
			Items []runtime.RawExtension `json:"items"`
		}
		if err := json.Unmarshal(js, &list); err != nil {
			return fmt.Errorf("%s: %w", tm.Kind, err)
		}
		for i, item := range list.Items {
			if err := p.parseObject(item.Raw); err != nil {
				me := &ManifestError{}
				if !errors.As(err, &me) {
					me = &ManifestError{Err: err}
				}
				me.Item = fmt.Sprintf("items[%d]", i)
				return me
			}
		}
		return nil

	case tm.APIVersion == "v1" && tm.Kind == "Service":
		var svc v1.Service
		if err := yaml.UnmarshalStrict(js, &svc); err != nil {
			return wrap(err)
		}
		defaultNamespace(&svc.ObjectMeta.Namespace)
		skip, err := p.b.AddService(&svc)
		if err != nil {
			return wrap(err)
		}
		if skip != "" {
			p.skipped = append(p.skipped, Skipped{Object: obj, Reason: skip})
		}
		return nil

	case tm.APIVersion == "discovery.k8s.io/v1" && tm.Kind == "EndpointSlice":
		var es discovery.EndpointSlice
		if err := yaml.UnmarshalStrict(js, &es); err != nil {
			return wrap(err)
		}
		defaultNamespace(&es.Namespace)
		p.slices[[2]string{es.Namespace, es.Labels[LabelServiceName]}] = true
		skip, err := p.b.AddSlice(&es)
		if err != nil {
			return wrap(err)
		}
		if skip != "" {
			p.skipped = append(p.skipped, Skipped{Object: obj, Reason: skip})
		}
		return nil

	case tm.APIVersion == "v1" && tm.Kind == "Endpoints":
		var eps v1.Endpoints
		if err := yaml.UnmarshalStrict(js, &eps); err != nil {
			return wrap(err)
		}
		defaultNamespace(&eps.Namespace)
		slices, err := EndpointsToSlices(&eps)
		if err != nil {
			return wrap(err)
		}
		for _, es := range slices {
			if _, err := SliceEndpoints(es); err != nil {
				return wrap(err)
			}
		}
		p.legacy = append(p.legacy, slices...)
		return nil

	default:
		p.skipped = append(p.skipped, Skipped{Object: obj, Reason: "kind " + tm.APIVersion + " " + tm.Kind + " is not used by the proxy"})
		return nil
	}
}

func defaultNamespace(ns *string) {
	if *ns == "" {
		*ns = "default"
	}
}

// cleanJSONError drops the decoder's "error unmarshaling JSON: while decoding
// JSON:" prefixes, which say nothing to someone editing YAML.
func cleanJSONError(err error) error {
	msg := err.Error()
	for _, p := range []string{"error unmarshaling JSON: ", "while decoding JSON: ", "json: "} {
		msg = strings.TrimPrefix(msg, p)
	}
	if msg == err.Error() {
		return err
	}
	return errors.New(msg)
}
